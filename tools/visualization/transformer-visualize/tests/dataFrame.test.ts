import { describe, expect, it } from 'vitest';
import { decodeDataFrame, FrameError, halfToFloat } from '../src/protocol/dataFrame';
import { buildFrame } from './frames';

describe('decodeDataFrame', () => {
  it('decodes the protocol document example byte for byte (172 bytes, H = 157, P = 3)', () => {
    const header = '{"id":"g1","step":2,"hook":"blocks.0.resid_post","layer":0,"prompt_index":0,"tokens":[5,6],"dtype":"float32","shape":[1],"dims":["token"],"reduction":"norm"}';
    expect(header.length).toBe(157);
    const bytes = new Uint8Array(172);
    bytes.set([0x4d, 0x53, 0x44, 0x31, 0x9d, 0x00, 0x00, 0x00]);
    bytes.set(new TextEncoder().encode(header), 8);
    bytes.set([0x00, 0x00, 0xc0, 0x3f], 168);
    const frame = decodeDataFrame(bytes.buffer);
    expect(frame.header.hook).toBe('blocks.0.resid_post');
    expect(frame.header.tokens).toEqual([5, 6]);
    expect(frame.header.reduction).toBe('norm');
    expect(Array.from(frame.values)).toEqual([1.5]);
  });

  it('decodes float32 values in C order', () => {
    const values = [0, 1, -2.5, 3, 4, 5.25];
    const frame = decodeDataFrame(buildFrame({ id: 'g1', step: 0, hook: 'blocks.1.attn.q', layer: 1, prompt_index: 1, tokens: [0, 2], shape: [2, 3], dims: ['token', 'dim'], reduction: 'none' }, values));
    expect(frame.header.shape).toEqual([2, 3]);
    expect(Array.from(frame.values)).toEqual(values);
  });

  it('decodes float16 values, subnormals and infinities included', () => {
    const bits = [0x3c00, 0xc000, 0x3555, 0x0001, 0x7c00, 0x0000, 0x7bff];
    const frame = decodeDataFrame(buildFrame({ id: null, step: 7, hook: 'embed', layer: null, prompt_index: 0, tokens: [0, 7], shape: [7], dims: ['token'], reduction: 'norm' }, bits, 'float16'));
    expect(frame.values[0]).toBe(1);
    expect(frame.values[1]).toBe(-2);
    expect(frame.values[2]).toBeCloseTo(1 / 3, 3);
    expect(frame.values[3]).toBeCloseTo(5.96e-8, 10);
    expect(frame.values[4]).toBe(Infinity);
    expect(frame.values[5]).toBe(0);
    expect(frame.values[6]).toBe(65504);
    expect(Number.isNaN(halfToFloat(0x7e00))).toBe(true);
  });

  it('refuses frames that do not follow the layout, with a message saying what is wrong', () => {
    const good = buildFrame({ id: 'g', step: 0, hook: 'embed', layer: null, prompt_index: 0, tokens: [0, 2], shape: [2], dims: ['token'], reduction: 'norm' }, [1, 2]);
    const badMagic = good.slice(0);
    new Uint8Array(badMagic)[0] = 0x58;
    expect(() => decodeDataFrame(badMagic)).toThrow(/starts with "XSD1"/);
    expect(() => decodeDataFrame(good.slice(0, good.byteLength - 4))).toThrow(/needs 8/);
    expect(() => decodeDataFrame(good.slice(0, 6))).toThrow(FrameError);
    const longHeader = good.slice(0);
    new DataView(longHeader).setUint32(4, 10_000, true);
    expect(() => decodeDataFrame(longHeader)).toThrow(/runs past the frame/);
    const badDtype = buildFrame({ id: 'g', step: 0, hook: 'embed', layer: null, prompt_index: 0, tokens: [0, 1], shape: [1], dims: ['token'], reduction: 'norm' }, [1]);
    const bytes = new Uint8Array(badDtype);
    const at = new TextDecoder().decode(bytes).indexOf('float32');
    bytes.set(new TextEncoder().encode('float64'), at);  // same length: only the dtype changes
    expect(() => decodeDataFrame(badDtype)).toThrow(/float64/);
  });
});
