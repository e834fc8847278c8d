// The attribution frames as the server sends them (built byte by byte by frames.ts): read into a token's
// attribution, drawn as layers x (heads, MLP), kept per (prompt, position) by the store; a frame of another
// shape is refused.
import { beforeEach, describe, expect, it } from 'vitest';
import { createPinia, setActivePinia } from 'pinia';
import { decodeDataFrame } from '../src/protocol/dataFrame';
import { attributionMatrix, isAttributionFrame, readAttribution, sumOfParts } from '../src/lib/attribution';
import { useAttributionStore } from '../src/stores/attribution';
import { buildFrame } from './frames';

// 2 layers x (3 heads + MLP)
const VALUES = [0.5, -0.25, 1, 2, -1, 0.125, 0, 0.375];
const HEADER = {
  id: 'g1', step: 3, hook: 'attribution', layer: null, prompt_index: 1, tokens: [7, 8], shape: [1, 2, 4],
  dims: ['token', 'layer', 'component'], reduction: 'none', token_id: 42, logit: 4.5, embed: 0.75,
  attn_bias: [0.25, -0.5], final_norm_bias: 1.25,
};

describe('direct logit attribution', () => {
  beforeEach(() => setActivePinia(createPinia()));

  it('reads a frame into its token, a layers x (heads, MLP) matrix whose parts add up to the logit', () => {
    const frame = decodeDataFrame(buildFrame(HEADER, VALUES));
    expect(isAttributionFrame(frame)).toBe(true);
    const entry = readAttribution(frame);
    expect([entry.promptIndex, entry.position, entry.step, entry.tokenId, entry.layers, entry.heads]).toEqual([1, 7, 3, 42, 2, 3]);
    const matrix = attributionMatrix(entry);
    expect([matrix.rows, matrix.cols, [...matrix.values]]).toEqual([2, 4, VALUES]);
    expect(matrix.colLabels).toEqual(['head 0', 'head 1', 'head 2', 'MLP']);
    expect(matrix.rowLabels).toEqual(['layer 0', 'layer 1']);
    expect(sumOfParts(entry)).toBeCloseTo(2.75 + 0.75 - 0.25 + 1.25, 6);
  });

  it('keeps one entry per prompt and position until cleared, and refuses another shape', () => {
    const store = useAttributionStore();
    store.add(decodeDataFrame(buildFrame(HEADER, VALUES)));
    store.add(decodeDataFrame(buildFrame({ ...HEADER, tokens: [8, 9] }, VALUES)));
    expect(store.at(1, 7)?.tokenId).toBe(42);
    expect(store.tokens.size).toBe(2);
    expect(() => store.add(decodeDataFrame(buildFrame({ ...HEADER, shape: [2, 4] }, VALUES)))).toThrow(/expected \[1, layers, heads \+ 1\]/);
    store.clear();
    expect(store.at(1, 7)).toBeUndefined();
  });
});
