// A PNG dropped anywhere else on the page: its record (ours, or A1111's parameters) fills the form (page.js's
// `actions.reuseSettings`). It exports nothing: page.js imports it for its listeners.
import { $, actions, state } from "./state.js";

async function inflate(bytes) {
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}
// The PNG's text chunks (tEXt latin-1, zTXt and iTXt, compressed or not) -> {keyword: text}; null: not a PNG.
async function pngTexts(file) {
  const b = new Uint8Array(await file.arrayBuffer()), view = new DataView(b.buffer);
  if (b.length < 8 || ![137, 80, 78, 71, 13, 10, 26, 10].every((v, i) => b[i] === v)) return null;
  const latin1 = new TextDecoder("latin1"), utf8 = new TextDecoder("utf-8"), out = {};
  for (let at = 8; at + 8 <= b.length;) {
    const n = view.getUint32(at), type = latin1.decode(b.subarray(at + 4, at + 8)), data = b.subarray(at + 8, at + 8 + n);
    at += 12 + n;
    if (!["tEXt", "zTXt", "iTXt"].includes(type)) continue;
    const z = data.indexOf(0), key = latin1.decode(data.subarray(0, z));
    if (type === "tEXt") out[key] = latin1.decode(data.subarray(z + 1));
    else if (type === "zTXt") out[key] = latin1.decode(await inflate(data.subarray(z + 2)));
    else {
      const compressed = data[z + 1] === 1;
      let p = data.indexOf(0, z + 3); p = data.indexOf(0, p + 1);  // past the language tag and translated keyword
      out[key] = utf8.decode(compressed ? await inflate(data.subarray(p + 1)) : data.subarray(p + 1));
    }
  }
  return out;
}
// A1111's parameters text (infotext_utils.parse_generation_parameters' split): prompt, negative prompt, Key: value.
function parseA1111(text) {
  const lines = text.trim().split("\n");
  let last = lines.pop();
  const re = /\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)/g;
  if ([...last.matchAll(re)].length < 3) { lines.push(last); last = ""; }
  const prompt = [], negative = []; let neg = false;
  for (let line of lines) {
    if (line.startsWith("Negative prompt:")) { neg = true; line = line.slice(16).trim(); }
    (neg ? negative : prompt).push(line);
  }
  const fields = {};
  for (const [, k, v] of last.matchAll(re)) {
    const value = v.trim();
    fields[k.trim()] = value.startsWith('"') && value.endsWith('"') && value.length > 1 ? JSON.parse(value) : value;
  }
  return { prompt: prompt.join("\n"), negative: negative.join("\n"), fields };
}
function fromOurs(r) {
  const fixed = new Set((state.server && state.server.server_loras || []).map((x) => x.slice(0, x.lastIndexOf(":"))));
  const loras = (r.loras || []).map((l) => [l.name.replace(/\.safetensors$/, ""), l.scale]).filter(([n]) => !fixed.has(n));
  return { prompt: r.prompt, negative_prompt: r.negative_prompt, seed: r.seed, steps: r.steps, guidance: r.guidance,
           size: `${r.width}x${r.height}`, strength: r.strength, n: 1, loras: loras.map(([n, w]) => `${n}:${w}`),
           boxes: r.boxes, images: (r.references || []).length + (r.init_image ? 1 : 0), mask: Boolean(r.mask) };
}
function fromA1111(text) {
  const { prompt, negative, fields: f } = parseA1111(text);
  const num = (k) => (f[k] !== undefined && f[k] !== "" && !isNaN(Number(f[k])) ? Number(f[k]) : undefined);
  return { prompt, negative_prompt: negative, seed: num("Seed"), steps: num("Steps"), guidance: num("CFG scale"),
           size: /^\d+x\d+$/.test(f.Size || "") ? f.Size : undefined, strength: num("Denoising strength"), n: 1 };
}
async function readSettingsFile(file) {
  const texts = file.type === "image/png" || /\.png$/i.test(file.name) ? await pngTexts(file).catch(() => null) : null;
  if (!texts) { $("error").textContent = `${file.name} is not a PNG: drop a PNG made here or by A1111 / Forge to read its settings`; return; }
  let s, source;
  if (texts.flux_klein_mlx) {
    try { s = fromOurs(JSON.parse(texts.flux_klein_mlx)); source = "its record"; } catch (e) { /* a damaged record: A1111's text */ }
  }
  if (!s && texts.parameters) { s = fromA1111(texts.parameters); source = "its A1111 parameters"; }
  if (!s) { $("error").textContent = `${file.name} holds no settings (no record, no A1111 parameters)`; return; }
  $("error").textContent = "";
  actions.reuseSettings(s);
  $("reuse-note").textContent = `Settings read from ${file.name} (${source}). ` + $("reuse-note").textContent.replace(/^Settings restored[.;] ?/, "");
}
// Only on the Generate tab: the Train tab's drops are its data (its drop zone), never a PNG's settings.
const generating = () => !$("generate-tab").classList.contains("hidden");
document.addEventListener("dragover", (e) => { e.preventDefault(); if (generating()) document.body.classList.add("dropping"); });
document.addEventListener("dragleave", (e) => { if (!e.relatedTarget) document.body.classList.remove("dropping"); });
document.addEventListener("drop", async (e) => {
  e.preventDefault(); document.body.classList.remove("dropping");
  if (!generating()) return;
  const [file] = e.dataTransfer.files;
  if (file) await readSettingsFile(file);
});
$("png-file").addEventListener("change", async () => {
  const [file] = $("png-file").files; $("png-file").value = "";
  if (file) await readSettingsFile(file);
});
