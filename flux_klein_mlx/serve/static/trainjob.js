// A fine-tuning job followed on the Train tab: its status and steps, a live loss plot and the samples as
// they arrive (from GET /v1/fine_tuning/jobs/{id} and its events), Cancel (stops at the next step, keeps
// the last checkpoint), Resume (continues from it), and "use this LoRA", which fills the generate form.
import { $, actions, state } from "./state.js";

const POLL_MS = 500;
const train = state.train;
const OVER = new Set(["succeeded", "failed", "cancelled"]);

export async function api(path, init = {}) {
  const r = await fetch(path, Object.assign({}, init, { headers: actions.headers(init.headers) }));
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error((body.error && body.error.message) || `HTTP ${r.status}`);
  return body;
}

// Follow `job` (a job object) until it is over: its events streamed (GET .../events?stream=true), its
// object read every POLL_MS; a second call follows the new one instead.
export async function followJob(job) {
  const mine = { id: job.id };
  if (!train.job || train.job.id !== job.id) forget();
  train.following = mine;
  showJob(job);
  const events = readEvents(job.id, mine).catch((err) => { $("train-error").textContent = err.message; });
  while (train.following === mine && !OVER.has(train.job.status)) {
    await new Promise((done) => setTimeout(done, POLL_MS));
    try {
      const now = await api(`/v1/fine_tuning/jobs/${job.id}`);
      if (train.following === mine) showJob(now);
    } catch (err) { $("train-error").textContent = err.message; }
  }
  await events;  // it ends once the job has ended ("[DONE]")
  if (train.following === mine) showJob(train.job);  // with every checkpoint counted (Resume needs one)
}

// No job followed any more (a new one is being made): its plot, samples and buttons cleared.
export function forget() {
  Object.assign(train, { following: null, job: null, losses: [], seen: new Set(), samples: [], checkpoints: 0 });
  $("train-samples").replaceChildren(); $("train-loss-line").setAttribute("points", ""); $("train-loss-note").textContent = "";
  for (const id of ["train-cancel", "train-resume", "train-use"]) $(id).classList.add("hidden");
}

function showJob(job) {
  train.job = job;
  const steps = job.steps || (train.losses.length ? train.losses.at(-1).total : 0);
  const done = job.trained_tokens || (train.losses.length ? train.losses.at(-1).step : 0);
  $("train-progress").max = steps || 1; $("train-progress").value = done;
  const words = { validating_files: "checking the data and settings…", queued: "queued", running: "training",
                  succeeded: "done", failed: "failed", cancelled: "cancelled" }[job.status] || job.status;
  $("train-status").textContent = `${job.id}: ${words}${steps ? ` · step ${done} / ${steps}` : ""}`
    + (job.fine_tuned_model ? ` · LoRA ${job.fine_tuned_model}` : "");
  if (job.status === "failed" && job.error) $("train-error").textContent = job.error.message;
  $("train-cancel").classList.toggle("hidden", OVER.has(job.status));
  const stopped = job.status === "cancelled" || job.status === "failed";
  $("train-resume").classList.toggle("hidden", !stopped || !train.checkpoints);  // it resumes from a checkpoint
  if (stopped && !train.checkpoints) $("train-status").textContent += " · no checkpoint yet: Start training again to retry";
  $("train-use").classList.toggle("hidden", !(job.status === "succeeded" && job.fine_tuned_model));
}

// The job's events, oldest first, as server-sent events: a step's loss goes to the plot (a resumed job's
// steps from its checkpoint on replace those of the first run), a sample to the samples.
async function readEvents(id, mine) {
  const r = await fetch(`/v1/fine_tuning/jobs/${id}/events?stream=true`, { headers: actions.headers() });
  if (!r.ok) throw new Error(((await r.json().catch(() => ({}))).error || {}).message || `HTTP ${r.status}`);
  const reader = r.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  while (train.following === mine) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, cut).split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("");
      buffer = buffer.slice(cut + 2);
      if (data === "[DONE]") return;
      if (data && train.following === mine) await onEvent(id, JSON.parse(data));
    }
  }
  reader.cancel();
}
async function onEvent(id, e) {
  if (train.seen.has(e.id)) return;
  train.seen.add(e.id);
  const d = e.data || {};
  if (e.type === "metrics" && Number.isFinite(d.train_loss)) {
    while (train.losses.length && train.losses.at(-1).step >= d.step) train.losses.pop();
    train.losses.push({ step: d.step, loss: d.train_loss, total: d.total_steps });
    drawLoss();
  } else if (d.fine_tuned_model_checkpoint) {
    train.checkpoints++;
  } else if (Array.isArray(d.samples)) {
    for (const path of d.samples) await showSample(id, d.step, path);
  }
}

// The loss of each step as a line on the SVG (viewBox 400 x 160), its axes' ends written beside it.
function drawLoss() {
  const pts = train.losses;
  if (!pts.length) return;
  const last = pts.at(-1).total || pts.at(-1).step, lo = Math.min(...pts.map((p) => p.loss)), hi = Math.max(...pts.map((p) => p.loss));
  const x = (s) => 4 + 392 * (last > 1 ? (s - 1) / (last - 1) : 0.5), y = (v) => 156 - 152 * (hi > lo ? (v - lo) / (hi - lo) : 0.5);
  $("train-loss-line").setAttribute("points", pts.map((p) => `${x(p.step).toFixed(1)},${y(p.loss).toFixed(1)}`).join(" "));
  $("train-loss-note").textContent = `loss ${pts.at(-1).loss.toFixed(4)} at step ${pts.at(-1).step} · range ${lo.toFixed(4)} – ${hi.toFixed(4)}`;
}

// A sample the events name, read with the key (an <img> cannot send it), shown with its step.
async function showSample(id, step, path) {
  const r = await fetch(`/v1/fine_tuning/jobs/${id}/samples/${path}`, { headers: actions.headers() });
  if (!r.ok) return;
  const blob = await r.blob();
  const figure = document.createElement("figure");
  const img = document.createElement("img"); img.src = URL.createObjectURL(blob); img.alt = `sample at step ${step}`;
  const cap = document.createElement("figcaption");
  cap.textContent = step ? `step ${step}` : "before training (no LoRA)";
  figure.append(img, cap);
  train.samples.push({ step, path, blob, figure });
  $("train-samples").append(figure);
}

$("train-cancel").addEventListener("click", async () => {
  if (!train.job) return;
  try { showJob(await api(`/v1/fine_tuning/jobs/${train.job.id}/cancel`, { method: "POST" })); }
  catch (err) { $("train-error").textContent = err.message; }
});
$("train-resume").addEventListener("click", async () => {
  if (!train.job) return;
  $("train-error").textContent = "";
  try { await followJob(await api(`/v1/fine_tuning/jobs/${train.job.id}/resume`, { method: "POST" })); }
  catch (err) { $("train-error").textContent = err.message; }
});
// The trained LoRA, picked at strength 1 in the generate form (the server's LoRA list read again first).
$("train-use").addEventListener("click", async () => {
  const name = train.job && train.job.fine_tuned_model;
  if (!name) return;
  await actions.refreshStatus();
  const row = [...document.querySelectorAll("#loras .lora")].find((el) => el.dataset.name === name);
  if (!row) { $("train-error").textContent = `the LoRA ${name} is not in the server's list yet; try again`; return; }
  row.querySelector("input[type=checkbox]").checked = true; row.querySelector("input[type=number]").value = "1";
  const trigger = (train.job.training || {}).trigger;
  if (trigger && !$("prompt").value.includes(trigger)) $("prompt").value = `${trigger}, ${$("prompt").value}`.replace(/, $/, "");
  actions.showTab("generate");
  $("reuse-note").textContent = `LoRA ${name} picked (strength 1)${trigger ? `; its trigger ${trigger} is in the prompt` : ""}.`;
});

// The newest job, followed when the tab opens (a reload, another tab's job).
export async function followNewest() {
  if (train.following) return;
  try {
    const list = await api("/v1/fine_tuning/jobs?limit=1");
    if (list.data.length && !train.following) followJob(list.data[0]);
  } catch (err) { /* no fine-tuning here: the tab says so when it starts */ }
}
