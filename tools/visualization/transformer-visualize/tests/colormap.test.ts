import { describe, expect, it } from 'vitest';
import { colorAt, labelStride, paint, paintRows, valueRange } from '../src/lib/colormap';

const TOP = colorAt('sequential', 1).map(Math.round);
const pixel = (out: Uint8ClampedArray, i: number) => Array.from(out.slice(4 * i, 4 * i + 3));

describe('color map', () => {
  it('per row: every row\'s largest value gets the top color, masked (NaN) cells stay blank', () => {
    // three queries over 4 keys: small, spread attention; the second row's keys 2 and 3 are masked; the
    // third is the first query, which attends only to itself
    const values = new Float32Array([0.3, 0.2, 0.25, 0.25, 0.02, 0.01, NaN, NaN, 1, NaN, NaN, NaN]);
    const whole = new Uint8ClampedArray(4 * values.length);
    expect(paint('sequential', values, valueRange('sequential', values), whole)).toBe(7);  // the finite cells
    expect(pixel(whole, 4)).not.toEqual(TOP);  // one range for the matrix: the second row is all dark
    const rows = new Uint8ClampedArray(4 * values.length);
    expect(paintRows('sequential', values, 4, rows)).toBe(7);
    expect(pixel(rows, 0)).toEqual(TOP);
    expect(pixel(rows, 4)).toEqual(TOP);
    expect(pixel(rows, 6)).toEqual([255, 255, 255]);
    expect(pixel(rows, 8)).toEqual(TOP);
  });

  it('labels every k-th row or column when cells are too small for each to carry one', () => {
    expect(labelStride(12, 9)).toBe(1);
    expect(labelStride(4.7, 9)).toBe(2);
    expect(labelStride(0.5, 9)).toBe(18);
  });
});
