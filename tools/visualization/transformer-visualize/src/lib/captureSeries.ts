// Captured records, kept per (prompt, hook) as one row of values per token position, and the matrices
// the views draw from them. Rows of one series may differ in size (a decode step's attention row has one
// more key than the previous one), so every row keeps its own shape.
import type { DataFrame } from '../protocol/dataFrame';

export interface Row {
  shape: number[];
  values: Float32Array;
}

export interface CaptureSeries {
  hook: string;        // full name, e.g. blocks.3.attn.q
  shortHook: string;   // without blocks.{l}., e.g. attn.q
  layer: number | null;
  promptIndex: number;
  dims: string[];      // axis names of one row (the token axis removed)
  reduction: string;
  rows: Map<number, Row>;
}

export function shortHookName(hook: string): string {
  return hook.replace(/^blocks\.\d+\./, '');
}

export function seriesKey(promptIndex: number, hook: string): string {
  return `${promptIndex}|${hook}`;
}

/** Split a frame along its token axis into the series it belongs to (created when new). */
export function addFrame(series: Map<string, CaptureSeries>, frame: DataFrame): void {
  const { header, values } = frame;
  const key = seriesKey(header.prompt_index, header.hook);
  let target = series.get(key);
  if (!target) {
    target = {
      hook: header.hook, shortHook: shortHookName(header.hook), layer: header.layer, promptIndex: header.prompt_index,
      dims: header.dims.slice(1), reduction: header.reduction, rows: new Map(),
    };
    series.set(key, target);
  }
  const rowShape = header.shape.slice(1);
  const rowSize = rowShape.reduce((a, b) => a * b, 1);
  const [start] = header.tokens;
  // views into the frame's values, not copies: a frame is decoded for its series alone and never changed
  for (let t = 0; t < header.shape[0]; t++) {
    target.rows.set(start + t, { shape: rowShape, values: values.subarray(t * rowSize, (t + 1) * rowSize) });
  }
}

export interface Matrix {
  rows: number;
  cols: number;
  values: Float32Array;  // row-major; NaN where nothing was captured
  rowLabels: string[];
  colLabels: string[];
}

/** Layers x flattened row values of one hook at one token (the Q/K/V heatmaps). */
export function layersAtToken(series: Map<string, CaptureSeries>, promptIndex: number, shortHook: string, token: number): Matrix {
  const picked = [...series.values()]
    .filter((s) => s.promptIndex === promptIndex && s.shortHook === shortHook && s.layer !== null && s.rows.has(token))
    .sort((a, b) => (a.layer ?? 0) - (b.layer ?? 0));
  const cols = Math.max(0, ...picked.map((s) => s.rows.get(token)!.values.length));
  const values = new Float32Array(picked.length * cols).fill(NaN);
  picked.forEach((s, r) => values.set(s.rows.get(token)!.values, r * cols));
  const dims = picked[0]?.dims ?? [];
  const shape = picked[0]?.rows.get(token)!.shape ?? [];
  return { rows: picked.length, cols, values, rowLabels: picked.map((s) => `layer ${s.layer}`), colLabels: columnLabels(dims, shape, cols) };
}

function columnLabels(dims: string[], shape: number[], cols: number): string[] {
  const labels: string[] = [];
  for (let c = 0; c < cols; c++) {
    let rest = c;
    const parts: string[] = [];
    for (let d = shape.length - 1; d >= 0; d--) {
      parts.unshift(`${dims[d] ?? 'dim'} ${rest % shape[d]}`);
      rest = Math.floor(rest / shape[d]);
    }
    labels.push(parts.join(', ') || `dim ${c}`);
  }
  return labels;
}

/** Number of heads of an attention-pattern series (1 when the heads were averaged away). */
export function headCount(s: CaptureSeries): number {
  const headAxis = s.dims.indexOf('head');
  const first = s.rows.values().next().value as Row | undefined;
  return headAxis >= 0 && first ? first.shape[headAxis] : 1;
}

/** Query x key attention matrix of one layer and head (rows: token positions captured). Keys after a row's
 *  query are masked (causal attention): the prefill's block carries them as zeros, but they stay NaN here, so
 *  they are drawn blank rather than as an attention of 0. */
export function attentionMatrix(s: CaptureSeries, head: number, tokenTexts: string[]): Matrix {
  const n = Math.max(tokenTexts.length, ...[...s.rows.keys()].map((t) => t + 1));
  const values = new Float32Array(n * n).fill(NaN);
  const headAxis = s.dims.indexOf('head');
  for (const [t, row] of s.rows) {
    const keys = row.shape[row.shape.length - 1];
    const offset = headAxis >= 0 ? head * keys : 0;
    const width = Math.min(keys, n, t + 1);
    values.set(row.values.subarray(offset, offset + width), t * n);
  }
  const labels = Array.from({ length: n }, (_, i) => tokenTexts[i] ?? `#${i}`);
  return { rows: n, cols: n, values, rowLabels: labels, colLabels: labels };
}

/** Layers x token positions of one hook, each cell the L2 norm of that token's row (a norm-reduced row is its own value). */
export function layersByTokens(series: Map<string, CaptureSeries>, promptIndex: number, shortHook: string): Matrix {
  const picked = [...series.values()]
    .filter((s) => s.promptIndex === promptIndex && s.shortHook === shortHook && s.layer !== null)
    .sort((a, b) => (a.layer ?? 0) - (b.layer ?? 0));
  const cols = Math.max(0, ...picked.flatMap((s) => [...s.rows.keys()].map((t) => t + 1)));
  const values = new Float32Array(picked.length * cols).fill(NaN);
  picked.forEach((s, r) => {
    for (const [t, row] of s.rows) values[r * cols + t] = Math.hypot(...row.values);
  });
  return {
    rows: picked.length, cols, values,
    rowLabels: picked.map((s) => `layer ${s.layer}`), colLabels: Array.from({ length: cols }, (_, t) => String(t)),
  };
}
