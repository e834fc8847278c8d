// Color scales for the heatmaps: sequential (attention probabilities, norms) and diverging (signed
// activations, centred on 0), as RGB bytes for ImageData.

export type ScaleKind = 'sequential' | 'diverging';

export const EMPTY_RGB: [number, number, number] = [255, 255, 255];

// A few stops of the viridis scale, interpolated linearly.
const SEQUENTIAL: [number, number, number][] = [
  [68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37],
];
const DIVERGING: [number, number, number][] = [
  [33, 102, 172], [146, 197, 222], [247, 247, 247], [244, 165, 130], [178, 24, 43],
];

/** t in [0, 1] -> RGB along the chosen scale. */
export function colorAt(kind: ScaleKind, t: number): [number, number, number] {
  const stops = kind === 'sequential' ? SEQUENTIAL : DIVERGING;
  const x = Math.min(1, Math.max(0, Number.isFinite(t) ? t : 0)) * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(x));
  const f = x - i;
  const a = stops[i];
  const b = stops[i + 1];
  return [a[0] + (b[0] - a[0]) * f, a[1] + (b[1] - a[1]) * f, a[2] + (b[2] - a[2]) * f];
}

export interface Range {
  min: number;
  max: number;
}

/** [min, max] of the finite values; null when there are none. */
function finiteExtent(values: Float32Array): Range | null {
  let min = Infinity;
  let max = -Infinity;
  for (const v of values) {
    if (!Number.isFinite(v)) continue;
    if (v < min) min = v;
    if (v > max) max = v;
  }
  return min === Infinity ? null : { min, max };
}

/** The value range a scale spans: [min, max] of the finite values, symmetric about 0 when diverging. */
export function valueRange(kind: ScaleKind, values: Float32Array): Range {
  const extent = finiteExtent(values);
  if (extent === null) return { min: 0, max: 1 };
  const { min, max } = extent;
  if (kind === 'diverging') {
    const m = Math.max(Math.abs(min), Math.abs(max)) || 1;
    return { min: -m, max: m };
  }
  return max > min ? { min, max } : { min, max: min + 1 };
}

const LEVELS = 256;
const TABLES: Record<ScaleKind, Uint8ClampedArray> = { sequential: table('sequential'), diverging: table('diverging') };

function table(kind: ScaleKind): Uint8ClampedArray {
  const rgb = new Uint8ClampedArray(3 * LEVELS);
  for (let i = 0; i < LEVELS; i++) rgb.set(colorAt(kind, i / (LEVELS - 1)), 3 * i);
  return rgb;
}

/** Fill RGBA pixels (one per value) for the values; non-finite values get the empty color. Returns the number
 *  of cells colored (the finite values).
 *  A million cells (attention at 1,000 tokens) per redraw: colors come from a 256-level table.
 *  gamma < 1 spreads the small values (attention over many keys is mostly small). */
export function paint(kind: ScaleKind, values: Float32Array, range: Range, out: Uint8ClampedArray, gamma = 1): number {
  const colors = TABLES[kind];
  const span = range.max - range.min;
  let colored = 0;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    const o = 4 * i;
    if (v === v && v !== Infinity && v !== -Infinity) {
      colored += 1;
      const t = Math.min(1, Math.max(0, (v - range.min) / span));
      const level = 3 * Math.round((gamma === 1 ? t : t ** gamma) * (LEVELS - 1));
      out[o] = colors[level];
      out[o + 1] = colors[level + 1];
      out[o + 2] = colors[level + 2];
    } else {
      out[o] = EMPTY_RGB[0];
      out[o + 1] = EMPTY_RGB[1];
      out[o + 2] = EMPTY_RGB[2];
    }
    out[o + 3] = 255;
  }
  return colored;
}

/** Each row painted on its own range, from 0 (or the row's minimum, if below 0) to the row's largest value:
 *  attention over a hundred keys is small everywhere, so one range for the whole matrix leaves it nearly
 *  uniformly dark; per row, every query's most attended key gets the top color. */
export function paintRows(kind: ScaleKind, values: Float32Array, cols: number, out: Uint8ClampedArray, gamma = 1): number {
  let colored = 0;
  for (let start = 0; start < values.length; start += cols) {
    const row = values.subarray(start, start + cols);
    const extent = finiteExtent(row);
    const low = extent === null ? 0 : Math.min(0, extent.min);
    // a row of one value (the first query attends only to itself) still reaches the top color
    const range = kind === 'diverging' ? valueRange(kind, row)
      : { min: low, max: extent !== null && extent.max > low ? extent.max : low + 1 };
    colored += paint(kind, row, range, out.subarray(4 * start, 4 * (start + cols)), gamma);
  }
  return colored;
}

/** Show every k-th label so that labels are at least `minPx` apart when each cell is `cellPx` wide. */
export function labelStride(cellPx: number, minPx: number): number {
  return cellPx >= minPx ? 1 : Math.ceil(minPx / Math.max(cellPx, 1e-6));
}
