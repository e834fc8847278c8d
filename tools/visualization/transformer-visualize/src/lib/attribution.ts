// Direct logit attribution frames (docs/megascope_protocol.md, "Direct logit attribution"): one per generated
// token, values [1, layers, heads + 1] (each head, then the MLP) and the other parts of the chosen token's logit
// in the header. Kept per (prompt, position); the view draws one token's layers x components matrix.
import type { DataFrame, DataHeader } from '../protocol/dataFrame';
import type { Matrix } from './captureSeries';

export const ATTRIBUTION_HOOK = 'attribution';

export interface AttributionHeader extends DataHeader {
  token_id: number;
  logit: number;
  embed: number;
  attn_bias: number[];
  final_norm_bias: number;
}

export interface TokenAttribution {
  promptIndex: number;
  position: number;        // where the chosen token is in its prompt's text
  step: number;
  tokenId: number;
  logit: number;
  embed: number;
  attnBias: number[];      // per layer
  finalNormBias: number;
  layers: number;
  heads: number;
  values: Float32Array;    // [layers, heads + 1], row-major
}

export function isAttributionFrame(frame: DataFrame): boolean {
  return frame.header.hook === ATTRIBUTION_HOOK;
}

export function attributionKey(promptIndex: number, position: number): string {
  return `${promptIndex}|${position}`;
}

/** A decoded attribution frame -> its token's attribution; a frame of another shape is refused. */
export function readAttribution(frame: DataFrame): TokenAttribution {
  const header = frame.header as AttributionHeader;
  const [tokens, layers, components] = header.shape;
  if (header.shape.length !== 3 || tokens !== 1 || components < 2) {
    throw new Error(`attribution frame of shape ${JSON.stringify(header.shape)}: expected [1, layers, heads + 1]`);
  }
  return {
    promptIndex: header.prompt_index, position: header.tokens[0], step: header.step, tokenId: header.token_id,
    logit: header.logit, embed: header.embed, attnBias: header.attn_bias, finalNormBias: header.final_norm_bias,
    layers, heads: components - 1, values: frame.values,
  };
}

/** Every part added up: the chosen token's logit, up to float32 rounding of the values. */
export function sumOfParts(a: TokenAttribution): number {
  let total = a.embed + a.finalNormBias + a.attnBias.reduce((x, y) => x + y, 0);
  for (const v of a.values) total += v;
  return total;
}

/** Layers x (heads, MLP): the heatmap of one token. */
export function attributionMatrix(a: TokenAttribution): Matrix {
  return {
    rows: a.layers, cols: a.heads + 1, values: a.values,
    rowLabels: Array.from({ length: a.layers }, (_, l) => `layer ${l}`),
    colLabels: [...Array.from({ length: a.heads }, (_, h) => `head ${h}`), 'MLP'],
  };
}
