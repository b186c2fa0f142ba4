// The history: results kept in this browser's IndexedDB (PNG blobs with their metadata chunks; localStorage
// holds only ~5 MB), shown newest first, opened large on a click; each item's buttons are page.js's (`actions`).
import { $, HISTORY_MAX, actions, state } from "./state.js";

function db() {
  return new Promise((resolve, reject) => {
    const req = indexedDB.open("flux_klein_mlx", 1);
    req.onupgradeneeded = () => req.result.createObjectStore("history", { keyPath: "id" });
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });
}
export async function store(mode, work) {
  const d = await db();
  return new Promise((resolve, reject) => {
    const tx = d.transaction("history", mode);
    const out = work(tx.objectStore("history"));
    tx.oncomplete = () => resolve(out && out.result);
    tx.onerror = () => reject(tx.error);
  });
}
export async function saveHistory(entry) {
  try {
    await store("readwrite", (st) => st.put(entry));
    const extra = state.history.slice(HISTORY_MAX);
    state.history = state.history.slice(0, HISTORY_MAX);
    if (extra.length) await store("readwrite", (st) => extra.forEach((h) => st.delete(h.id)));
  } catch (e) { /* private mode or full: the history lasts this session only */ }
}
export async function loadHistory() {
  try {
    const all = await store("readonly", (st) => st.getAll());
    state.history = (all || []).sort((a, b) => b.created - a.created).slice(0, HISTORY_MAX);
  } catch (e) { state.history = []; }
  renderHistory();
}

export function renderHistory() {
  $("history").replaceChildren(...state.history.map((h) => {
    const item = document.createElement("div"); item.className = "item";
    const img = document.createElement("img"); img.src = URL.createObjectURL(h.blob); img.alt = h.metadata.prompt;
    img.title = "open large"; img.onclick = () => openViewer(h, img.src);
    const cap = document.createElement("div"); cap.textContent = `#${h.metadata.seed} ${h.metadata.prompt}`; cap.title = h.metadata.prompt;
    const reuse = document.createElement("button"); reuse.type = "button"; reuse.className = "reuse"; reuse.textContent = "reuse";
    reuse.onclick = () => actions.reuseSettings(h.settings);
    item.append(img, cap, reuse, actions.downloadLink(h), document.createElement("br"), ...actions.useButtons(h));
    return item;
  }));
}

function openViewer(h, src) {
  $("viewer-img").src = src;
  $("viewer-caption").textContent = `${h.metadata.width} × ${h.metadata.height} · seed ${h.metadata.seed} · ${h.metadata.prompt}`
    + (h.metadata.revised_prompt ? ` → ${h.metadata.revised_prompt}` : "");
  $("viewer").showModal();
}
$("viewer").addEventListener("click", () => $("viewer").close());
