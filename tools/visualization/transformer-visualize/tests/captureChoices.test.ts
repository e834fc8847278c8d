import { describe, expect, it } from 'vitest';
import { buildCaptureSpec, captureHookNames, formatReduction, reductionForms } from '../src/lib/captureChoices';
import { initialSettings, rememberSettings } from '../src/stores/settings';

const HOOKS = ['embed', 'blocks.{l}.ln1', 'blocks.{l}.attn.q', 'blocks.{l}.attn.pattern', 'blocks.{l}.resid_post', 'final_norm', 'logits'];

describe('capture choices', () => {
  it('offers the declared reduction forms with their parameters', () => {
    const forms = reductionForms(['none', 'norm', 'bins(n)', 'slice(a,b)', 'topk_abs(k)']);
    expect(forms[2]).toEqual({ name: 'bins', params: ['n'] });
    expect(formatReduction(forms[3], [2, 10])).toBe('slice(2,10)');
    expect(formatReduction(forms[1], [7])).toBe('norm');
  });

  it('builds a CaptureSpec with short hook names, per-hook reductions and a PCA layer only for per-layer hooks', () => {
    expect(captureHookNames(HOOKS)).toEqual(['embed', 'ln1', 'attn.q', 'attn.pattern', 'resid_post', 'final_norm', 'logits']);
    const base = { hooks: ['attn.q', 'embed'], allLayers: false, layerStart: 1, layerEnd: 3, reduction: 'bins(8)', perHook: { embed: 'norm', 'attn.q': '' }, topk: 3, logitLens: true, pcaHook: 'resid_post', pcaLayer: 2, attribution: true };
    expect(buildCaptureSpec(base, HOOKS)).toEqual({
      hooks: ['attn.q', 'embed'], layers: [1, 3], tokens: null, reduction: 'bins(8)', reductions: { embed: 'norm' }, topk: 3, logit_lens: true, pca: { hook: 'resid_post', layer: 2 },
      attribution: true,
    });
    expect(buildCaptureSpec({ ...base, allLayers: true, pcaHook: 'final_norm' }, HOOKS).pca).toEqual({ hook: 'final_norm', layer: null });
    // a per-layer hook's PCA of every captured layer: one pca message per layer
    expect(buildCaptureSpec({ ...base, pcaLayer: null }, HOOKS).pca).toEqual({ hook: 'resid_post', layer: null });
  });
});

describe('connection settings', () => {
  it('takes ?url= first, then local storage, then VITE_MEGASCOPE_URL, then the default port on the page host', () => {
    const storage = new Map<string, string>();
    const kv = { getItem: (k: string) => storage.get(k) ?? null, setItem: (k: string, v: string) => void storage.set(k, v) };
    expect(initialSettings(kv, '', undefined, 'example.org')).toEqual({ url: 'ws://example.org:5001/', token: '', connectAtOnce: false });
    expect(initialSettings(kv, '', 'ws://env:7/', 'example.org').url).toBe('ws://env:7/');
    rememberSettings(kv, { url: 'ws://stored:9/', token: 'secret' });
    expect(initialSettings(kv, '', 'ws://env:7/', 'example.org')).toEqual({ url: 'ws://stored:9/', token: 'secret', connectAtOnce: false });
    // an address in the page's own address is connected to at once
    expect(initialSettings(kv, '?url=ws%3A%2F%2Fquery%3A1%2F&token=t', 'ws://env:7/', 'x')).toEqual({ url: 'ws://query:1/', token: 't', connectAtOnce: true });
  });
});
