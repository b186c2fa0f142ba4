// The page's behaviour: the form, the server's state in the header, runs and their stream, results. An ES
// module, the one index.html loads: it imports the page's other modules (the history, the mask brush, a dropped
// PNG's settings, the layout boxes, outpainting, the Train tab) and hands them its own functions through state.js's `actions`.
// Served at /static/NAME.js beside index.html (no outside resources).
import { $, HISTORY_MAX, actions, state } from "./state.js";
import { boxesForRequest, boxesProblem, layout, setBoxes, showBoxes, sizeBoxCanvas } from "./boxes.js";
import { clearBrush, openBrush } from "./brush.js";
import { loadHistory, renderHistory, saveHistory, store } from "./history.js";
import { outpaint } from "./outpaint.js";
import "./png.js";
import "./train.js";
const POLL_MS = 250;  // the header follows the server within a second, also on a loaded machine (400 missed by 1 ms)
$("history-max").textContent = HISTORY_MAX;

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = $("apikey").value || localStorage.getItem("flux_klein_api_key") || "";
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function fetchStatus() {
  const r = await fetch("/v1/status", { headers: headers() });
  if (r.status === 401) return null;
  return r.json();
}

// The header is what the server last said, never a guess from this page: "ready" when nothing runs or
// waits, else "● generating" (with our own run's step when the stream gave one) and how many jobs wait.
function showHeader() {
  const s = state.server;
  if (!s) return;
  const idle = !s.running && !s.waiting;
  $("status").textContent = s.switching ? `switching to ${s.switching}…`
    : s.state === "ready" ? `${s.model} (${s.variant})${idle ? " ready" : ""}`
    : s.state === "loading" ? "loading the model…" : "failed: " + s.error;
  $("busy").classList.toggle("hidden", idle);
  $("busy").textContent = idle ? "" : ["● generating", s.running && state.busy ? state.detail : "",
                                       s.waiting ? `${s.waiting} queued` : ""].filter(Boolean).join(" · ");
}

// One read of /v1/status. A refused key shows the key field ("API key required"); the first read that works
// leaves that mode at once: the key is kept, its field hidden, and the model's own fields shown.
async function refreshStatus() {
  let s;
  try { s = await fetchStatus(); } catch (e) { $("status").textContent = "server unreachable"; return; }
  if (!s) {
    state.keyNeeded = true; state.server = null;
    $("key-row").classList.remove("hidden"); $("busy").classList.add("hidden");
    $("status").textContent = $("apikey").value ? "API key refused: check it" : "API key required";
    return;
  }
  if (state.keyNeeded && $("apikey").value) localStorage.setItem("flux_klein_api_key", $("apikey").value);
  state.keyNeeded = false; $("key-row").classList.add("hidden");
  state.server = s;
  showHeader();
  if (s.state === "ready") applyServer(s);
}
// The header follows the server (another tab's job, a cancel, the queue) by reading it every POLL_MS.
async function pollStatus() {
  if (!state.keyNeeded) await refreshStatus();  // a refused key waits for a new one (the field's input)
  setTimeout(pollStatus, POLL_MS);
}
let keyTimer = null;
$("apikey").addEventListener("input", () => { clearTimeout(keyTimer); keyTimer = setTimeout(refreshStatus, 250); });

function applyServer(s) {
  // Several models: a picker (set to the loaded one when first shown); the fields follow the picked one.
  const models = s.models || [];
  $("model-row").classList.toggle("hidden", models.length < 2);
  if ([...$("model-pick").options].map((o) => o.value).join("\n") !== models.map((m) => m.id).join("\n")) {
    $("model-pick").replaceChildren(...models.map((m) => new Option(m.id, m.id)));
    $("model-pick").value = s.model;
  }
  const card = models.find((m) => m.id === $("model-pick").value) || s;
  // Base models take guidance and a negative prompt; distilled ones ignore both.
  $("base-only").classList.toggle("hidden", card.distilled !== false);
  $("upsample-box").classList.toggle("hidden", !(card.upsampler ?? s.upsampler));
  showBoxes(Boolean(card.upsampler ?? s.upsampler));  // boxes.js: FLUX 3 (the family with an upsampler) reads a layout
  $("steps").placeholder = String(card.default_steps);
  if (s.limits) $("count").max = String(s.limits.max_n);
  const have = [...document.querySelectorAll("#loras .lora")].map((el) => el.dataset.name).join("\n");
  if (have !== (s.loras || []).join("\n")) {
    $("loras").replaceChildren(...(s.loras || []).map((name) => {
      const row = document.createElement("div"); row.className = "lora"; row.dataset.name = name;
      const box = document.createElement("input"); box.type = "checkbox"; box.id = "lora-" + name;
      const label = document.createElement("label"); label.className = "inline"; label.htmlFor = box.id; label.textContent = name;
      const scale = document.createElement("input"); scale.type = "number"; scale.step = "0.05"; scale.value = "1";
      scale.min = "-4"; scale.max = "4"; scale.title = "strength";
      row.append(box, label, scale);
      return row;
    }));
  }
  $("lora-box").classList.toggle("hidden", !(s.loras || []).length);
  // LoRAs the server loaded with the model apply to every image, under the ones picked here.
  const fixed = s.server_loras || [];
  $("server-loras").textContent = fixed.length ? `server LoRAs: ${fixed.join(", ")}` : "";
  $("server-loras").classList.toggle("hidden", !fixed.length);
}

// ---- images, mask, mode ------------------------------------------------------------------------
function thumb(file, onRemove) {
  const fig = document.createElement("figure");
  const img = document.createElement("img");
  img.src = URL.createObjectURL(file); img.alt = file.name;
  const x = document.createElement("button");
  x.type = "button"; x.textContent = "×"; x.title = "remove";
  x.onclick = (ev) => { ev.stopPropagation(); onRemove(); };
  fig.append(img, x);
  return fig;
}
function renderFiles() {
  $("refs").replaceChildren(...state.refs.map((f, i) => thumb(f.file, () => { state.refs.splice(i, 1); renderFiles(); })));
  $("mask").replaceChildren(...(state.mask ? [thumb(state.mask.file, () => { state.mask = null; clearBrush(); renderFiles(); })] : []));
  $("brush-open").classList.toggle("hidden", !state.refs.length || !$("brush-box").classList.contains("hidden"));
  if (!state.refs.length) $("brush-box").classList.add("hidden");
  else if (!$("brush-box").classList.contains("hidden") && state.brushFor !== state.refs[0]) openBrush();
  outpaint.follow();  // the outpaint view closes once its image is not the first any more
  describeMode(); describeSize();
}
// Only images the browser decodes become thumbnails; anything else is refused at the drop, by name.
async function acceptImages(files) {
  const good = [], refused = [];
  for (const file of files) {
    if (!file.type.startsWith("image/")) { refused.push(`${file.name} is not an image (${file.type || "unknown type"})`); continue; }
    try {
      const bitmap = await createImageBitmap(file);
      good.push({ file, width: bitmap.width, height: bitmap.height });
      bitmap.close();
    } catch (e) { refused.push(`${file.name} is not a readable image`); }
  }
  $("error").textContent = refused.length ? `${refused.join("; ")}: use PNG, JPEG or WebP files` : "";
  return good;
}
function describeMode() {
  const n = state.refs.length, strength = $("strength").value;
  $("strength").disabled = n === 0;
  const others = n > 1 ? `; the other ${n - 1} image(s) are references` : "";
  $("mode-note").textContent =
    outpaint.active() ? `outpainting: the first image on a larger canvas (drag its edges), the new area painted${others}`
    : state.mask && !n ? "add the image to repaint: with a mask, the first image is the one being repainted"
    : state.mask ? `inpainting: the first image is the one being repainted where the mask is white${others}`
    : n && strength !== "" ? `img2img: the first image is the starting point, strength ${strength}${others}`
    : n ? `editing with ${n} reference image(s)` : "text to image";
}
function dropZone(zone, input, add) {
  zone.addEventListener("click", () => input.click());
  zone.addEventListener("dragover", (e) => { e.preventDefault(); e.stopPropagation(); zone.classList.add("over"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", async (e) => {
    e.preventDefault(); e.stopPropagation(); zone.classList.remove("over"); document.body.classList.remove("dropping");
    add(await acceptImages([...e.dataTransfer.files])); renderFiles();
  });
  input.addEventListener("change", async () => {
    const files = [...input.files]; input.value = "";
    add(await acceptImages(files)); renderFiles();
  });
}
dropZone($("refs-drop"), $("refs-file"), (files) => state.refs.push(...files));
dropZone($("mask-drop"), $("mask-file"), (files) => { if (files.length) { clearBrush(); state.mask = files[0]; } });
$("strength").addEventListener("input", describeMode);

// ---- size presets ------------------------------------------------------------------------------
function applyPreset() {
  const v = $("size-preset").value, auto = v === "auto";
  $("width").disabled = auto; $("height").disabled = auto;
  if (v.includes("x")) { const [w, h] = v.split("x"); $("width").value = w; $("height").value = h; }
  describeSize();
}
// The size "auto" gives, as the server computes it: the first image shrunk to 1024² px of area when larger
// (sides truncated), then both sides floored to multiples of 16; without images 1024 × 1024.
function autoSize() {
  if (!state.refs.length) return [1024, 1024, "no image: the default"];
  let { width: w, height: h } = state.refs[0];
  if (w * h > 1024 * 1024) { const k = Math.sqrt(1024 * 1024 / (w * h)); w = Math.trunc(w * k); h = Math.trunc(h * k); }
  return [w - (w % 16), h - (h % 16), "the first image's size"];
}
function describeSize() {
  const auto = $("size-preset").value === "auto";
  $("size-note").classList.toggle("hidden", !auto);
  if (auto) {
    const [w, h, why] = autoSize();
    $("width").value = w; $("height").value = h;
    $("size-note").textContent = `auto: ${w} × ${h} (${why})`;
  }
  sizeBoxCanvas();  // boxes.js: the layout canvas takes the size's aspect
}
$("size-preset").addEventListener("change", applyPreset);
for (const id of ["width", "height"]) {
  $(id).addEventListener("input", () => {
    const match = `${$("width").value}x${$("height").value}`;
    $("size-preset").value = [...$("size-preset").options].some((o) => o.value === match) ? match : "custom";
  });
}

// ---- a generation ------------------------------------------------------------------------------
function settings() {
  const s = { prompt: $("prompt").value.trim(), n: Number($("count").value || 1) };
  if (!$("model-row").classList.contains("hidden")) s.model = $("model-pick").value;
  // img2img and inpainting make the first image's size whatever the size field says: none is sent.
  const repaint = state.refs.length && (state.mask || $("strength").value !== "" || outpaint.active());
  if ($("size-preset").value !== "auto" && !repaint) s.size = `${$("width").value}x${$("height").value}`;
  if ($("seed").value !== "") s.seed = Number($("seed").value);
  if ($("steps").value !== "") s.steps = Number($("steps").value);
  if (!$("base-only").classList.contains("hidden")) {
    if ($("guidance").value !== "") s.guidance = Number($("guidance").value);
    if ($("negative").value.trim()) s.negative_prompt = $("negative").value.trim();
  }
  const loras = [...document.querySelectorAll("#loras .lora")].filter((el) => el.querySelector("input[type=checkbox]").checked)
    .map((el) => `${el.dataset.name}:${Number(el.querySelector("input[type=number]").value || 1)}`);
  if (loras.length) s.loras = loras;
  if (state.refs.length && $("strength").value !== "") s.strength = Number($("strength").value);
  if (!$("upsample-box").classList.contains("hidden") && $("upsample").checked) s.upsample = true;
  if (outpaint.active()) s.outpaint = outpaint.pads().join(",");  // as rounded and shown (outpaint.js)
  const boxes = boxesForRequest();  // boxes.js: "x0,y0,x1,y1:desc" strings; null when none or not offered
  if (boxes) s.boxes = boxes;
  return s;
}

async function* sseEvents(response) {
  // Server-sent events over a fetch body (EventSource cannot POST).
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
      let name = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      yield { name, data: JSON.parse(data) };
    }
  }
}

function seconds(t) { return t < 60 ? `${t.toFixed(1)} s` : `${Math.floor(t / 60)} min ${Math.round(t % 60)} s`; }

// What the run is doing before its first step: waiting behind other jobs (the server's counters tell:
// jobs ahead of ours finish first), then what the server says it does (a ".stage" event).
const STAGES = { model: "loading the picked model (the other one is released)…", upsample: "writing the caption (prompt upsampler)…", loras: "applying the LoRAs…", text_encoder: "loading the text encoder…", cached: "prompt cached · starting…" };
function startLabel(run, ahead) {
  return run.stage ? STAGES[run.stage] || run.stage : ahead > 0 ? `queued: ${ahead} job(s) ahead` : "starting…";
}
function watchStart(run) {
  const tick = async () => {
    if (run.started || run.over) return;
    try {
      const s = await fetchStatus();
      if (s && !run.started && !run.over) {
        $("step-label").textContent = startLabel(run, run.ahead - (s.completed - run.completedBefore));
      }
    } catch (e) { /* the stream reports failures */ }
    setTimeout(tick, 400);
  };
  tick();
}

function startRun() {
  $("error").textContent = "";
  $("results").replaceChildren(); $("reuse-note").textContent = "";
  $("preview-fig").classList.add("hidden"); $("preview").removeAttribute("src");
  $("progress").value = 0; $("progress").max = 1;
  state.busy = true; state.detail = ""; $("generate").disabled = true; $("cancel").classList.remove("hidden");
  document.title = "● flux_klein_mlx";
}
function endRun() {
  state.busy = false; state.detail = ""; state.controller = null; $("generate").disabled = false;
  $("cancel").classList.add("hidden"); document.title = "flux_klein_mlx";
  refreshStatus();
}

async function send(s, signal) {
  if (state.refs.length || state.mask) {
    const form = new FormData();
    for (const [k, v] of Object.entries(s)) {
      if (k === "loras") v.forEach((x) => form.append("loras", x));
      else form.append(k, k === "boxes" ? JSON.stringify(v) : String(v));  // a form carries boxes as JSON text
    }
    form.append("stream", "true");
    for (const f of state.refs) form.append("image[]", f.file, f.file.name);
    if (state.mask) form.append("mask", state.mask.file, state.mask.file.name);
    return fetch("/v1/images/edits", { method: "POST", body: form, headers: headers(), signal });
  }
  return fetch("/v1/images/generations", {
    method: "POST", headers: headers({ "Content-Type": "application/json" }), signal,
    body: JSON.stringify(Object.assign({ stream: true }, s)),
  });
}

async function generate(ev) {
  ev.preventDefault();
  if (state.busy) return;
  if (!state.server) {  // never run on fields this page has not shown: read the server first
    await refreshStatus();
    $("error").textContent = state.keyNeeded ? "the server needs its API key: type it above"
      : state.server ? "the key works: the model's settings are shown now; check them, then Generate"
      : "the server is unreachable";
    return;
  }
  const s = settings();
  if (!s.prompt) { $("error").textContent = "write a prompt first"; return; }
  const boxProblem = boxesProblem();  // boxes.js: a box without a name, which the server would refuse
  if (boxProblem) { $("error").textContent = boxProblem; return; }
  const [first, mask] = [state.refs[0], state.mask];
  if (first && mask && (first.width !== mask.width || first.height !== mask.height)) {
    $("error").textContent = `the mask is ${mask.width} × ${mask.height} but the image is ${first.width} × ${first.height}: ` +
      "they must be the same size (paint one with the brush)";
    return;
  }
  const refused = outpaint.active() && outpaint.refusal();
  if (refused) { $("error").textContent = refused; return; }
  startRun();
  sizePreview(s);
  const before = await fetchStatus().catch(() => null) || { running: false, waiting: 0, completed: 0 };
  const run = { started: false, over: false, t0: performance.now(), tFirst: null, done: 0, stage: null,
                ahead: (before.running ? 1 : 0) + before.waiting, completedBefore: before.completed,
                used: { images: state.refs.length, mask: Boolean(state.mask) } };
  state.controller = new AbortController();
  $("step-label").textContent = startLabel(run, run.ahead);
  watchStart(run);
  try {
    const response = await send(s, state.controller.signal);
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${response.status}`);
    }
    for await (const e of sseEvents(response)) {
      const d = e.data;
      if (e.name.endsWith(".stage")) { run.stage = d.stage; if (!run.started) $("step-label").textContent = startLabel(run, 0); }
      else if (e.name.endsWith(".progress")) showStep(run, d, s.n);
      else if (e.name.endsWith(".partial_image")) showPreview(run, d);
      else if (e.name.endsWith(".completed")) await showResult(d, s, run.used);
      else if (e.name === "error") throw new Error(d.error.message);
    }
    $("step-label").textContent = `done in ${seconds((performance.now() - run.t0) / 1000)}`;
    $("preview-fig").classList.add("hidden");
  } catch (err) {
    const cancelled = err.name === "AbortError";
    $("step-label").textContent = cancelled ? "cancelled" : "failed";
    if (!cancelled) { $("error").textContent = err.message; $("results").replaceChildren(); }
    $("preview-fig").classList.add("hidden");
  } finally {
    run.over = true;
    endRun();
  }
}

function showStep(run, d, n) {
  const now = performance.now();
  if (!run.started) { run.started = true; run.tFirst = now; run.firstDone = d.image_index * d.total_steps + d.step; }
  const done = d.image_index * d.total_steps + d.step, total = n * d.total_steps;
  $("progress").max = total; $("progress").value = done;
  const elapsed = (now - run.t0) / 1000;
  let eta = "";
  if (done > run.firstDone) {  // rate from the steps seen so far (not counting loading and encoding)
    const rate = (now - run.tFirst) / 1000 / (done - run.firstDone);
    eta = ` · about ${seconds(rate * (total - done))} left`;
  }
  const image = n > 1 ? `image ${d.image_index + 1}/${n} · ` : "";
  if (d.step === d.total_steps) {  // the VAE decodes after the last step: no estimate of steps left to give
    $("step-label").textContent = `${image}decoding… · ${seconds(elapsed)}`;
    state.detail = "decoding"; showHeader();
    return;
  }
  $("step-label").textContent = `${image}step ${d.step} / ${d.total_steps} · ${seconds(elapsed)}${eta}`;
  state.detail = `step ${d.step} / ${d.total_steps}`; showHeader();
}

// The preview holds the run's shape before its first picture arrives, so the page never scrolls to a
// figure that has no height yet (auto size: square until the picture tells).
function sizePreview(s) {
  const [w, h] = (s.size || "1x1").split("x").map(Number);
  $("preview").style.aspectRatio = `${w} / ${h}`;
}
function showPreview(run, d) {
  $("preview").src = "data:image/png;base64," + d.b64_json; $("preview-fig").classList.remove("hidden");
}
// On a phone the output is below the form: once a preview has drawn, keep it wholly in view.
$("preview").addEventListener("load", () => {
  if (!matchMedia("(max-width: 800px)").matches || $("preview-fig").classList.contains("hidden")) return;
  const r = $("preview-fig").getBoundingClientRect();
  if (r.top < 0 || r.bottom > innerHeight) $("preview-fig").scrollIntoView({ block: "start" });
});

function b64Blob(b64) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  return new Blob([bytes], { type: "image/png" });
}

async function showResult(d, requested, used) {
  const blob = d.b64_json ? b64Blob(d.b64_json) : await (await fetch(d.url)).blob();
  const m = d.metadata;
  // What "reuse" restores: the request as sent (LoRAs, n, strength, size, ...) with this image's seed and steps,
  // and how many images and whether a mask it used (the pictures themselves are not kept).
  const entry = { id: `${Date.now()}-${d.image_index}`, created: Date.now(), blob, metadata: m,
                  settings: Object.assign({ size: `${m.width}x${m.height}` }, requested, { seed: m.seed, steps: m.steps }, used) };
  const fig = document.createElement("figure");
  const img = document.createElement("img"); img.className = "result"; img.alt = "result"; img.src = URL.createObjectURL(blob);
  const cap = document.createElement("figcaption");
  cap.append(`${d.size}, seed ${m.seed}, ${d.seconds.toFixed(1)} s · `, downloadLink(entry), document.createElement("br"),
             ...useButtons(entry));
  const meta = document.createElement("pre"); meta.className = "meta";  // this image's record, beside it
  meta.textContent = Object.entries(m).filter(([, v]) => v !== null && !(Array.isArray(v) && !v.length))
    .map(([k, v]) => `${k}: ${showValue(k, v)}`).join("\n");
  fig.append(img, cap, meta);
  $("results").append(fig);
  // On a phone the output is below the form: bring the first result into view.
  if ($("results").children.length === 1 && matchMedia("(max-width: 800px)").matches) fig.scrollIntoView({ block: "start" });
  state.history.unshift(entry);
  await saveHistory(entry);
  renderHistory();
}

function downloadLink(entry) {
  const a = document.createElement("a");
  a.className = "download"; a.textContent = "download";
  a.href = URL.createObjectURL(entry.blob);
  a.download = `flux-klein-${entry.metadata.seed}-${entry.id}.png`;
  return a;
}

// The record's LoRAs are {name, sha256, scale}; images are content hashes.
function showValue(k, v) {
  if (k === "loras") return v.map(l => `${l.name.replace(/\.safetensors$/, "")}:${l.scale}`).join(", ");
  if (k === "boxes") return JSON.stringify(v);
  return Array.isArray(v) ? v.join(", ") : v;
}

// Everything the history entry holds goes back into the form; pictures are not kept, so say which were used.
function reuseSettings(s) {
  $("prompt").value = s.prompt;
  if (s.size) {
    const [w, h] = s.size.split("x"); $("width").value = w; $("height").value = h;
    $("size-preset").value = [...$("size-preset").options].some((o) => o.value === s.size) ? s.size : "custom";
  } else $("size-preset").value = "auto";
  applyPreset();
  $("seed").value = s.seed ?? ""; $("steps").value = s.steps ?? "";
  $("guidance").value = s.guidance ?? ""; $("negative").value = s.negative_prompt ?? ""; $("upsample").checked = !!s.upsample;
  $("count").value = s.n ?? 1; $("strength").value = s.strength ?? ""; setBoxes(s.boxes);
  const wanted = new Map((s.loras || []).map((x) => [x.slice(0, x.lastIndexOf(":")), x.slice(x.lastIndexOf(":") + 1)]));
  for (const row of document.querySelectorAll("#loras .lora")) {
    const on = wanted.has(row.dataset.name);
    row.querySelector("input[type=checkbox]").checked = on;
    if (on) { row.querySelector("input[type=number]").value = wanted.get(row.dataset.name); wanted.delete(row.dataset.name); }
  }
  const notes = [];
  if (s.images) notes.push(`it used ${s.images} image(s)${s.mask ? " and a mask" : ""}, which the history does not keep: add them again`);
  if (wanted.size) notes.push(`LoRA(s) ${[...wanted.keys()].join(", ")} are not on this server any more`);
  $("reuse-note").textContent = notes.length ? `Settings restored; ${notes.join("; ")}.` : "Settings restored.";
  describeMode();
}

// ---- the next step from a result: as a reference, as the image-to-image start, or to repaint ----------
const USES = { edit: "edit this", img2img: "img2img", inpaint: "inpaint", outpaint: "outpaint" };
function useButtons(entry) {
  return Object.entries(USES).map(([mode, words]) => {
    const b = document.createElement("button"); b.type = "button"; b.className = "use"; b.dataset.use = mode;
    b.textContent = words; b.onclick = () => useResult(entry, mode);
    return b;
  });
}
// The result becomes the only image: a reference ("edit this"), the start of img2img (strength 0.6 unless one
// is set), the image to repaint (the brush opens on it) or to outpaint (its canvas opens: outpaint.js). The
// size goes to "auto": the image's own.
async function useResult(entry, mode) {
  const [image] = await acceptImages([new File([entry.blob], `result-${entry.metadata.seed}.png`, { type: "image/png" })]);
  if (!image) return;
  state.refs = [image]; state.mask = null; clearBrush();
  $("size-preset").value = "auto"; applyPreset();
  $("strength").value = mode === "img2img" ? $("strength").value || "0.6" : "";
  $("brush-box").classList.toggle("hidden", mode !== "inpaint");
  renderFiles();
  if (mode === "inpaint") openBrush();
  if (mode === "outpaint") await outpaint.open(image);
  $("reuse-note").textContent = `${USES[mode]}: the result (seed ${entry.metadata.seed}) is the first image now.`;
  $("prompt").focus({ preventScroll: mode === "outpaint" });  // the canvas stays in view
}

// Ctrl+Enter (Cmd+Enter on a Mac) generates from anywhere on the page.
document.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); $("form").requestSubmit(); }
});

$("model-pick").addEventListener("change", () => state.server && applyServer(state.server));
$("form").addEventListener("submit", generate);
$("cancel").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
$("clear-history").addEventListener("click", async () => {
  try { await store("readwrite", (st) => st.clear()); } catch (e) { /* nothing stored */ }
  state.history = []; renderHistory();
});
Object.assign(actions, { renderFiles, reuseSettings, downloadLink, useButtons, describeMode, headers, refreshStatus });
// The browser tests read the page's state and call these (a module's names are not global): the one global.
window.flux = { state, layout, boxesForRequest, refreshStatus };
// Start: a module runs once the document is parsed and the modules it imports have run.
$("apikey").value = localStorage.getItem("flux_klein_api_key") || "";
pollStatus();
loadHistory();
