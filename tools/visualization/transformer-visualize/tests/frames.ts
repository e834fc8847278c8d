// Builds binary data frames byte by byte as docs/megascope_protocol.md lays them out (independently of
// the decoder under test), for the unit tests and the real-server tests' expectations.
export function buildFrame(header: object, values: number[], dtype: 'float32' | 'float16' = 'float32'): ArrayBuffer {
  const json = new TextEncoder().encode(JSON.stringify({ ...header, dtype }));
  const padding = (4 - ((8 + json.length) % 4)) % 4;
  const itemsize = dtype === 'float32' ? 4 : 2;
  const buffer = new ArrayBuffer(8 + json.length + padding + values.length * itemsize);
  const bytes = new Uint8Array(buffer);
  bytes.set([0x4d, 0x53, 0x44, 0x31], 0);
  new DataView(buffer).setUint32(4, json.length, true);
  bytes.set(json, 8);
  const view = new DataView(buffer, 8 + json.length + padding);
  values.forEach((v, i) => (dtype === 'float32' ? view.setFloat32(4 * i, v, true) : view.setUint16(2 * i, v, true)));
  return buffer;
}
