// Zip files in the browser, for the Train tab: `makeZip` writes the training data the page uploads (POST
// /v1/files takes one zip), `readZip` opens a dropped zip so its images and captions can be edited first.
// The writer stores (no compression: images are compressed already); the reader takes stored and deflated
// entries (the browser's DecompressionStream inflates). Names are UTF-8 (flag bit 11). Layout: APPNOTE.TXT
// (local header, data, central directory, end record); no zip64, so at most 65,535 entries and 4 GB.

const TABLE = Array.from({ length: 256 }, (_, n) => {
  let c = n;
  for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
  return c >>> 0;
});
function crc32(bytes) {
  let c = 0xffffffff;
  for (let i = 0; i < bytes.length; i++) c = TABLE[(c ^ bytes[i]) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

// entries: [{name: "10_fox/a.png", bytes: Uint8Array}] -> a Blob of the zip (stored entries)
export function makeZip(entries) {
  const parts = [], central = [];
  let offset = 0;
  for (const { name, bytes } of entries) {
    const utf8 = new TextEncoder().encode(name), crc = crc32(bytes);
    const head = new DataView(new ArrayBuffer(30));
    // signature, version 2.0, flags (UTF-8 names), method 0 (stored), time, date, crc, sizes, name length
    [[0, 0x04034b50, 4], [4, 20, 2], [6, 0x800, 2], [8, 0, 2], [10, 0, 2], [12, 0x21, 2], [14, crc, 4],
     [18, bytes.length, 4], [22, bytes.length, 4], [26, utf8.length, 2], [28, 0, 2]].forEach(([at, v, n]) => put(head, at, v, n));
    const dir = new DataView(new ArrayBuffer(46));
    [[0, 0x02014b50, 4], [4, 20, 2], [6, 20, 2], [8, 0x800, 2], [10, 0, 2], [12, 0, 2], [14, 0x21, 2], [16, crc, 4],
     [20, bytes.length, 4], [24, bytes.length, 4], [28, utf8.length, 2], [42, offset, 4]].forEach(([at, v, n]) => put(dir, at, v, n));
    parts.push(head, utf8, bytes); central.push(dir, utf8);
    offset += 30 + utf8.length + bytes.length;
  }
  const size = central.reduce((n, p) => n + p.byteLength, 0);
  const end = new DataView(new ArrayBuffer(22));
  [[0, 0x06054b50, 4], [8, entries.length, 2], [10, entries.length, 2], [12, size, 4], [16, offset, 4]]
    .forEach(([at, v, n]) => put(end, at, v, n));
  return new Blob([...parts, ...central, end], { type: "application/zip" });
}
function put(view, at, value, n) { n === 4 ? view.setUint32(at, value, true) : view.setUint16(at, value, true); }

// A dropped zip -> [{name, bytes}] of its files (folders left out); a zip it cannot read throws one line.
export async function readZip(blob) {
  const buf = new Uint8Array(await blob.arrayBuffer()), view = new DataView(buf.buffer);
  let end = buf.length - 22;
  while (end >= 0 && view.getUint32(end, true) !== 0x06054b50) end--;  // the end record, after any comment
  if (end < 0) throw new Error(`${blob.name || "the file"} is not a zip file`);
  const count = view.getUint16(end + 10, true);
  let at = view.getUint32(end + 16, true);
  const files = [];
  for (let i = 0; i < count; i++) {
    if (view.getUint32(at, true) !== 0x02014b50) throw new Error(`${blob.name}: its directory is damaged; zip the files again`);
    const method = view.getUint16(at + 10, true), packed = view.getUint32(at + 20, true);
    const nameLength = view.getUint16(at + 28, true), extra = view.getUint16(at + 30, true), note = view.getUint16(at + 32, true);
    const name = new TextDecoder().decode(buf.subarray(at + 46, at + 46 + nameLength));
    const local = view.getUint32(at + 42, true);
    const start = local + 30 + view.getUint16(local + 26, true) + view.getUint16(local + 28, true);
    at += 46 + nameLength + extra + note;
    if (name.endsWith("/")) continue;
    const data = buf.subarray(start, start + packed);
    if (method === 0) files.push({ name, bytes: data.slice() });
    else if (method === 8) files.push({ name, bytes: await inflate(data) });
    else throw new Error(`${blob.name}: ${name} is compressed with method ${method}; zip it with deflate or none`);
  }
  return files;
}
async function inflate(data) {
  const stream = new Blob([data]).stream().pipeThrough(new DecompressionStream("deflate-raw"));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}
