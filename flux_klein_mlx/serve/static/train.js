// The Train tab: the data (images dropped, or a zip; a caption beside each thumbnail and the caption as it
// trains, the trigger applied), the settings (a Base model, a preset, the options people change), the memory
// plan before anything starts, and "Start training": the data zipped here, uploaded (POST /v1/files), a job
// made (POST /v1/fine_tuning/jobs). trainjob.js follows the job. It uses the fine-tuning API and nothing else
// (docs/server.md#the-train-tab).
import { $, actions, state } from "./state.js";
import { api, followJob, followNewest, forget } from "./trainjob.js";
import { makeZip, readZip } from "./zip.js";

const IMAGE = /\.(png|jpe?g|webp)$/i, CAPTION = /\.(txt|caption)$/i;
const CONTROL = /^control(_[1-9][0-9]{0,2})?\//;  // a zip's --control folders travel as they are
// The presets: the README's first run (4-bit base, gradient checkpointing), or the base as it is stored.
const PRESETS = {
  recipe: { steps: 500, rank: 16, lr: 1e-4, resolution: 512, sample_every: 100, save_every: 250, quantize: 4, low_memory: true },
  full: { steps: 500, rank: 16, lr: 1e-4, resolution: 512, sample_every: 100, save_every: 250, quantize: null, low_memory: false },
};
const train = state.train;

// ---- the tabs --------------------------------------------------------------------------------------------
function showTab(name) {
  for (const tab of ["generate", "train"]) {
    $(`${tab}-tab`).classList.toggle("hidden", tab !== name);
    $(`tab-${tab}`).setAttribute("aria-selected", String(tab === name));
  }
  if (name === "train") { showModels(); planSoon(); followNewest(); }
}
$("tab-generate").addEventListener("click", () => showTab("generate"));
$("tab-train").addEventListener("click", () => showTab("train"));

// ---- the data ----------------------------------------------------------------------------------------------
// The caption as `train` reads it (train/data/dataset.with_trigger): "[trigger]" replaced, else the trigger
// put first as "WORD, " unless the caption holds it as a word already.
function withTrigger(caption, trigger) {
  if (!trigger) return caption;
  if (caption.includes("[trigger]")) return caption.replaceAll("[trigger]", trigger);
  const word = new RegExp(`(?<![\\p{L}\\p{N}_])${trigger.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")}(?![\\p{L}\\p{N}_])`, "u");
  return word.test(caption) ? caption : `${trigger}, ${caption}`;
}
const stem = (name) => name.replace(/\.[^./]*$/, "");

// Dropped files (images, their .txt captions, zips) -> train.items [{name, blob, caption}] and train.extra
// (a zip's control folders); a file that is neither, or a name already here, is refused by name.
async function addFiles(files) {
  const entries = [], refused = [];
  for (const file of files) {
    if (/\.zip$/i.test(file.name) || file.type === "application/zip") {
      try { entries.push(...(await readZip(file)).map((e) => ({ name: e.name, blob: new Blob([e.bytes]) }))); }
      catch (err) { refused.push(err.message); }
    } else entries.push({ name: file.name, blob: file });
  }
  const captions = new Map();
  for (const e of entries.filter((e) => CAPTION.test(e.name))) captions.set(stem(e.name), (await e.blob.text()).trim());
  for (const e of entries) {
    if (CONTROL.test(e.name)) train.extra.push(e);
    else if (CAPTION.test(e.name) || /(^|\/)(__MACOSX\/|\.DS_Store$)/.test(e.name)) continue;
    else if (!IMAGE.test(e.name)) refused.push(`${e.name} is not an image (.png .jpg .jpeg .webp) or a caption (.txt)`);
    else if (train.items.some((it) => stem(it.name) === stem(e.name))) refused.push(`${e.name}: an image of that name is here already`);
    else train.items.push({ name: e.name, blob: e.blob, caption: captions.get(stem(e.name)) ?? "" });
  }
  for (const it of train.items) if (!it.caption && captions.has(stem(it.name))) it.caption = captions.get(stem(it.name));
  $("train-error").textContent = refused.join("; ");
  renderItems(); planSoon();
}

function renderItems() {
  $("train-items").replaceChildren(...train.items.map((it, i) => {
    const row = document.createElement("div"); row.className = "train-item";
    const img = document.createElement("img"); img.src = URL.createObjectURL(it.blob); img.alt = it.name; img.title = it.name;
    const text = document.createElement("textarea"); text.className = "caption"; text.value = it.caption;
    text.placeholder = `caption of ${it.name}`; text.setAttribute("aria-label", `caption of ${it.name}`);
    const shown = document.createElement("div"); shown.className = "note trains-as";
    const show = () => { shown.textContent = `trains as: ${withTrigger(it.caption, $("train-trigger").value.trim()) || "(no caption)"}`; };
    text.addEventListener("input", () => { it.caption = text.value; show(); planSoon(); });
    const x = document.createElement("button"); x.type = "button"; x.textContent = "×"; x.title = `remove ${it.name}`;
    x.onclick = () => { train.items.splice(i, 1); renderItems(); planSoon(); };
    const side = document.createElement("div"); side.append(text, shown);
    row.append(img, side, x); show();
    return row;
  }));
  const extra = train.extra.length ? ` and ${train.extra.length} control image(s)` : "";
  $("train-count").textContent = train.items.length ? `${train.items.length} image(s)${extra}` : "";
}
$("train-trigger").addEventListener("input", renderItems);
const zone = $("train-drop");
zone.addEventListener("click", () => $("train-file").click());
zone.addEventListener("dragover", (e) => { e.preventDefault(); e.stopPropagation(); zone.classList.add("over"); });
zone.addEventListener("dragleave", () => zone.classList.remove("over"));
zone.addEventListener("drop", (e) => {
  e.preventDefault(); e.stopPropagation(); zone.classList.remove("over"); document.body.classList.remove("dropping");
  addFiles([...e.dataTransfer.files]);
});
$("train-file").addEventListener("change", () => { const files = [...$("train-file").files]; $("train-file").value = ""; addFiles(files); });

// ---- the settings ------------------------------------------------------------------------------------------
// The Base models the server serves (a distilled one is not trained: train/plan refuses it).
function showModels() {
  const bases = ((state.server && state.server.models) || []).filter((m) => m.distilled === false).map((m) => m.id);
  if ([...$("train-model").options].map((o) => o.value).join("\n") !== bases.join("\n")) {
    $("train-model").replaceChildren(...bases.map((id) => new Option(id, id)));
  }
  $("train-no-base").classList.toggle("hidden", bases.length > 0 || !state.server);
}
function applyPreset() {
  const p = PRESETS[$("train-preset").value];
  for (const k of ["steps", "rank", "lr", "resolution", "sample_every", "save_every"]) $(`train-${k.replace("_", "-")}`).value = p[k];
  planSoon();
}
$("train-preset").addEventListener("change", applyPreset);

// The job's body: OpenAI's fields, and train's options by their names under `training`.
function jobBody(fileId) {
  const p = PRESETS[$("train-preset").value];
  const prompts = $("train-prompts").value.split("\n").map((s) => s.trim()).filter(Boolean);
  const training = { steps: Number($("train-steps").value), rank: Number($("train-rank").value), lr: Number($("train-lr").value),
                     resolution: $("train-resolution").value.split(",").map((s) => Number(s.trim())),
                     save_every: Number($("train-save-every").value), quantize: p.quantize, low_memory: p.low_memory };
  const trigger = $("train-trigger").value.trim();
  if (trigger) training.trigger = trigger;
  if (prompts.length) Object.assign(training, { sample_prompts: prompts, sample_every: Number($("train-sample-every").value) });
  if (prompts.length && $("train-sample-steps").value !== "") training.sample_steps = Number($("train-sample-steps").value);
  const body = { model: $("train-model").value, training };
  if (fileId) body.training_file = fileId;
  if ($("train-suffix").value.trim()) body.suffix = $("train-suffix").value.trim();
  return body;
}

// ---- the data uploaded, the plan, the start ----------------------------------------------------------------
// The data as `train` reads it, zipped here and uploaded (POST /v1/files): again only when it changed (an image,
// a caption); the upload it replaces is deleted unless a job reads it. One upload at a time.
let uploads = Promise.resolve();
function upload() {
  const next = uploads.then(uploadNow, uploadNow);
  uploads = next.catch(() => {});
  return next;
}
async function uploadNow() {
  const key = JSON.stringify([train.items.map((it) => [it.name, it.blob.size, it.caption.trim()]), train.extra.map((e) => e.name)]);
  if (train.upload && train.upload.key === key) return train.upload;
  const files = train.items.flatMap((it) => [{ name: it.name, blob: it.blob },  // an empty caption: none (train says so)
                                             ...(it.caption.trim() ? [{ name: `${stem(it.name)}.txt`, blob: new Blob([it.caption.trim()]) }] : [])]);
  const entries = await Promise.all([...files, ...train.extra].map(async (e) => ({ name: e.name, bytes: new Uint8Array(await e.blob.arrayBuffer()) })));
  const form = new FormData();
  form.append("purpose", "fine-tune"); form.append("file", makeZip(entries), "training-data.zip");
  const file = await api("/v1/files", { method: "POST", body: form });
  const old = train.upload;
  train.upload = { key, id: file.id, used: false };
  if (old && !old.used) api(`/v1/files/${old.id}`, { method: "DELETE" }).catch(() => {});
  return train.upload;
}

// The memory plan of the data and settings: the job's own checks and plan without a job (POST
// /v1/fine_tuning/jobs with dry_run), redone half a second after the last change; "planning…" until then
// (an older answer is dropped).
let planTimer = null, planAsked = 0;
function planSoon() {
  clearTimeout(planTimer); planAsked++; train.plan = null; showModels();
  $("train-plan").classList.remove("bad");
  $("train-plan").textContent = !$("train-model").value ? "" : train.items.length ? "planning the memory…"
    : "drop the images to see the memory plan";
  if ($("train-model").value && train.items.length) planTimer = setTimeout(showPlan, 500);
}
async function showPlan() {
  const asked = planAsked;
  let plan, said;
  try {
    const { id } = await upload();
    plan = await api("/v1/fine_tuning/jobs", { method: "POST", headers: { "Content-Type": "application/json" },
                                               body: JSON.stringify(Object.assign(jobBody(id), { dry_run: true })) });
  } catch (err) { said = err.message; }
  if (asked !== planAsked) return;  // the settings changed meanwhile: their own plan comes
  const m = plan && plan.memory;
  train.plan = m ? plan : null;
  $("train-plan").classList.toggle("bad", !m || !m.fits);
  $("train-plan").textContent = !m ? said || "no memory plan for these settings"
    : `${plan.images} image(s), ${plan.steps} steps · ${m.description}: `
      + (m.fits ? "it fits" : `it will not fit; it fits with ${m.remedies.join("; ") || "none of the options"}`);
}
for (const id of ["train-model", "train-steps", "train-rank", "train-lr", "train-resolution", "train-sample-every",
                  "train-sample-steps", "train-save-every", "train-prompts", "train-trigger"]) {
  $(id).addEventListener("input", planSoon);
}

// What would stop a job before it is sent, said here in one line (the server checks everything again).
function problem() {
  if (!train.items.length) return "drop the training images first (with their .txt captions, or a zip)";
  if (!$("train-model").value) return "this server serves no Base model: start it with a Base model to train";
  const bare = train.items.filter((it) => !it.caption.trim()).map((it) => it.name);
  if (bare.length) return `write a caption for ${bare.slice(0, 3).join(", ")}${bare.length > 3 ? ", ..." : ""}`;
  return "";
}
async function start() {
  $("train-error").textContent = problem();
  if ($("train-error").textContent) return;
  $("train-start").disabled = true;
  forget();
  try {
    $("train-status").textContent = "uploading the data…";
    const data = await upload();
    const job = await api("/v1/fine_tuning/jobs", { method: "POST", headers: { "Content-Type": "application/json" },
                                                    body: JSON.stringify(jobBody(data.id)) });
    data.used = true;  // the job reads it (and a resume does): never deleted from here
    await followJob(job);
  } catch (err) {
    $("train-error").textContent = err.message; $("train-status").textContent = "failed";
  } finally { $("train-start").disabled = false; }
}
$("train-start").addEventListener("click", start);
Object.assign(actions, { showTab });
applyPreset();
