import { describe, expect, it } from 'vitest';
import { decodeDataFrame } from '../src/protocol/dataFrame';
import { addFrame, attentionMatrix, headCount, layersAtToken, layersByTokens, seriesKey, type CaptureSeries } from '../src/lib/captureSeries';
import { buildFrame } from './frames';

function frame(hook: string, layer: number | null, tokens: [number, number], shape: number[], dims: string[], values: number[], step = 0) {
  return decodeDataFrame(buildFrame({ id: 'g1', step, hook, layer, prompt_index: 0, tokens, shape, dims, reduction: 'none' }, values));
}

describe('capture series', () => {
  it('assembles an attention matrix from the prefill block and the decode rows', () => {
    const series = new Map<string, CaptureSeries>();
    // prefill: 2 query tokens x 2 heads x 2 keys; decode step 1: 1 token x 2 heads x 3 keys
    addFrame(series, frame('blocks.0.attn.pattern', 0, [0, 2], [2, 2, 2], ['token', 'head', 'key'], [1, 0, 1, 0, 0.5, 0.5, 0.25, 0.75]));
    addFrame(series, frame('blocks.0.attn.pattern', 0, [2, 3], [1, 2, 3], ['token', 'head', 'key'], [0.2, 0.3, 0.5, 0.1, 0.1, 0.8], 1));
    const s = series.get(seriesKey(0, 'blocks.0.attn.pattern'))!;
    expect(s.shortHook).toBe('attn.pattern');
    expect(headCount(s)).toBe(2);
    const head1 = attentionMatrix(s, 1, ['a', 'b', 'c']);
    expect(head1.rows).toBe(3);
    expect(head1.values[0]).toBe(1);
    expect(Number.isNaN(head1.values[1])).toBe(true);  // masked (key 1 after query 0): blank, not the prefill's 0
    expect(Array.from(head1.values.slice(3, 5))).toEqual([0.25, 0.75]);
    expect(Array.from(head1.values.slice(6, 9))).toEqual([0.10000000149011612, 0.10000000149011612, 0.800000011920929]);
    expect(Number.isNaN(head1.values[2])).toBe(true);  // a key after the query: never attended, left empty
    expect(head1.rowLabels).toEqual(['a', 'b', 'c']);
  });

  it('stacks one hook over layers at a token, and takes norms over layers x tokens', () => {
    const series = new Map<string, CaptureSeries>();
    addFrame(series, frame('blocks.1.attn.q', 1, [0, 2], [2, 2], ['token', 'dim'], [1, 2, 3, 4]));
    addFrame(series, frame('blocks.0.attn.q', 0, [0, 2], [2, 2], ['token', 'dim'], [5, 6, 7, 8]));
    addFrame(series, frame('embed', null, [0, 2], [2, 2], ['token', 'dim'], [9, 9, 9, 9]));
    const m = layersAtToken(series, 0, 'attn.q', 1);
    expect(m.rowLabels).toEqual(['layer 0', 'layer 1']);
    expect(Array.from(m.values)).toEqual([7, 8, 3, 4]);
    expect(m.colLabels).toEqual(['dim 0', 'dim 1']);
    const norms = layersByTokens(series, 0, 'attn.q');
    expect(norms.cols).toBe(2);
    expect(norms.values[0]).toBeCloseTo(Math.hypot(5, 6));
    expect(norms.values[3]).toBeCloseTo(5);
  });
});
