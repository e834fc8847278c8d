// Decoder of MegaScope's binary data frames (docs/megascope_protocol.md, "Binary data frames"):
// little-endian; 4 bytes magic "MSD1", uint32 header length H, H bytes of UTF-8 JSON header,
// zero padding up to a multiple of 4 bytes, then the values in C order (float16 or float32).
// A generation at a large model's shape streams tens of millions of values: they are read through typed
// arrays over the frame's own buffer (the padding aligns them; typed arrays are little-endian on every
// platform a browser runs on), float32 without a copy, float16 through a table of all 65,536 values.

export const MAGIC = 'MSD1';

export interface DataHeader {
  id: string | null;
  step: number;
  hook: string;
  layer: number | null;
  prompt_index: number;
  tokens: [number, number];
  dtype: 'float16' | 'float32';
  shape: number[];
  dims: string[];
  reduction: string;
}

export interface DataFrame {
  header: DataHeader;
  /** The values as float32, whatever the wire dtype was. */
  values: Float32Array;
}

export class FrameError extends Error {}

const BYTES_PER_VALUE = { float16: 2, float32: 4 } as const;

export function decodeDataFrame(buffer: ArrayBuffer): DataFrame {
  if (buffer.byteLength < 8) throw new FrameError(`data frame of ${buffer.byteLength} bytes is shorter than its 8-byte prefix`);
  const view = new DataView(buffer);
  const magic = String.fromCharCode(view.getUint8(0), view.getUint8(1), view.getUint8(2), view.getUint8(3));
  if (magic !== MAGIC) throw new FrameError(`data frame starts with "${magic}", not "${MAGIC}"`);
  const headerLength = view.getUint32(4, true);
  if (8 + headerLength > buffer.byteLength) throw new FrameError(`data frame header of ${headerLength} bytes runs past the frame`);
  let header: DataHeader;
  try {
    header = JSON.parse(UTF8.decode(new Uint8Array(buffer, 8, headerLength))) as DataHeader;
  } catch {
    throw new FrameError('data frame header is not JSON');
  }
  const bytesPerValue = BYTES_PER_VALUE[header.dtype];
  if (bytesPerValue === undefined) throw new FrameError(`data frame dtype "${String(header.dtype)}" is not float16 or float32`);
  if (!Array.isArray(header.shape) || header.shape.some((n) => !Number.isInteger(n) || n < 0)) {
    throw new FrameError('data frame shape is not a list of sizes');
  }
  const count = header.shape.reduce((a, b) => a * b, 1);
  const offset = align4(8 + headerLength);
  if (offset + count * bytesPerValue !== buffer.byteLength) {
    throw new FrameError(`data frame holds ${buffer.byteLength - offset} value bytes, shape ${JSON.stringify(header.shape)} of ${header.dtype} needs ${count * bytesPerValue}`);
  }
  return { header, values: readValues(buffer, offset, count, header.dtype) };
}

const UTF8 = new TextDecoder();

function align4(n: number): number {
  return (n + 3) & ~3;
}

function readValues(buffer: ArrayBuffer, offset: number, count: number, dtype: 'float16' | 'float32'): Float32Array {
  if (dtype === 'float32') return new Float32Array(buffer, offset, count);
  const bits = new Uint16Array(buffer, offset, count);
  const table = halfTable();
  const values = new Float32Array(count);
  for (let i = 0; i < count; i++) values[i] = table[bits[i]];
  return values;
}

let HALF_TABLE: Float32Array | null = null;  // built on the first float16 frame

function halfTable(): Float32Array {
  if (HALF_TABLE === null) {
    HALF_TABLE = new Float32Array(0x10000);
    for (let bits = 0; bits < 0x10000; bits++) HALF_TABLE[bits] = halfToFloat(bits);
  }
  return HALF_TABLE;
}

/** IEEE 754 binary16 -> number (DataView has no getFloat16 in the browsers and Node versions the page supports). */
export function halfToFloat(bits: number): number {
  const sign = bits & 0x8000 ? -1 : 1;
  const exponent = (bits >> 10) & 0x1f;
  const fraction = bits & 0x3ff;
  if (exponent === 0) return sign * 2 ** -14 * (fraction / 1024);
  if (exponent === 0x1f) return fraction ? NaN : sign * Infinity;
  return sign * 2 ** (exponent - 15) * (1 + fraction / 1024);
}
