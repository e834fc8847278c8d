// The capture choices the page offers, built only from what the welcome declares (hook names and
// reduction forms such as "bins(n)"), and the CaptureSpec they make.
import type { CaptureSpec } from '../protocol/messages';

export interface ReductionForm {
  name: string;
  params: string[];   // e.g. ["a", "b"] for slice(a,b)
}

export function reductionForms(declared: string[]): ReductionForm[] {
  return declared.map((form) => {
    const match = /^([a-z_]+)\((.*)\)$/.exec(form);
    return match ? { name: match[1], params: match[2].split(',').map((p) => p.trim()) } : { name: form, params: [] };
  });
}

export function formatReduction(form: ReductionForm, values: number[]): string {
  return form.params.length ? `${form.name}(${values.slice(0, form.params.length).join(',')})` : form.name;
}

/** "blocks.{l}.attn.q" -> "attn.q": the names a CaptureSpec uses. */
export function captureHookNames(declaredHooks: string[]): string[] {
  return declaredHooks.map((h) => h.replace(/^blocks\.\{l\}\./, ''));
}

export function isPerLayer(shortHook: string, declaredHooks: string[]): boolean {
  return declaredHooks.includes(`blocks.{l}.${shortHook}`);
}

export interface CaptureChoices {
  hooks: string[];
  allLayers: boolean;
  layerStart: number;
  layerEnd: number;
  reduction: string;
  perHook: Record<string, string>;   // hook -> reduction, '' = the default one
  topk: number;
  logitLens: boolean;
  pcaHook: string;                   // '' = no PCA
  pcaLayer: number | null;           // null: every captured layer (the PCA tab then switches layers)
  attribution: boolean;
}

export function buildCaptureSpec(choices: CaptureChoices, declaredHooks: string[]): CaptureSpec {
  const reductions: Record<string, string> = {};
  for (const hook of choices.hooks) if (choices.perHook[hook]) reductions[hook] = choices.perHook[hook];
  return {
    hooks: [...choices.hooks],
    layers: choices.allLayers ? null : [choices.layerStart, choices.layerEnd],
    tokens: null,
    reduction: choices.reduction,
    reductions,
    topk: choices.topk,
    logit_lens: choices.logitLens,
    pca: choices.pcaHook ? { hook: choices.pcaHook, layer: isPerLayer(choices.pcaHook, declaredHooks) ? choices.pcaLayer : null } : null,
    attribution: choices.attribution,
  };
}
