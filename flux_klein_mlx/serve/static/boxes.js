// The layout-box editor (FLUX 3): drag on a canvas of the image's shape to place an element, name it in its
// row. A box is {x0, y0, x1, y1, desc}: fractions of the image's width and height (top-left origin), rounded to
// 3 decimals, x0 < x1 and y0 < y1. Requests carry them as the server's "x0,y0,x1,y1:desc" strings
// (upsample/boxes.py), which a box without a name is not: the page refuses it before sending.
// It reads the form's width and height; page.js calls showBoxes (applyServer), sizeBoxCanvas (describeSize),
// boxesForRequest and boxesProblem (a generation) and setBoxes (reuse, a PNG).
import { $ } from "./state.js";

export const layout = { boxes: [], selected: -1, drag: null };
const MIN_BOX_PX = 4;  // a drag shorter than this (on screen, either side) is a click: it selects, adds nothing
const BOX_CANVAS_MAX_H = 320;  // CSS px: a portrait size shrinks the canvas's width instead of growing the form
const BOX_COLORS = ["#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#0fa3b1", "#f032e6", "#9a6324"];

const unit = (v) => Math.round(Math.min(1, Math.max(0, v)) * 1000) / 1000;  // clamped to the image, 3 decimals
const boxColor = (i) => BOX_COLORS[i % BOX_COLORS.length];
const boxCoords = (b) => [b.x0, b.y0, b.x1, b.y1].map((v) => v.toFixed(3)).join(",");

function boxesOffered() { return !$("boxes-box").classList.contains("hidden"); }

// The section shows when the picked model reads boxes (FLUX 3); sized once it is in the layout (hidden: 0 px).
export function showBoxes(on) {
  if (on === boxesOffered()) return;
  $("boxes-box").classList.toggle("hidden", !on);
  if (on) sizeBoxCanvas();
}

// The canvas takes the width x height fields' aspect, as wide as the form allows and at most
// BOX_CANVAS_MAX_H tall; its pixels are the screen's (devicePixelRatio) so names stay sharp.
export function sizeBoxCanvas() {
  if (!boxesOffered()) return;
  const w = Number($("width").value) || 1024, h = Number($("height").value) || 1024;
  const room = $("boxes-box").clientWidth || 300;
  const cssW = Math.max(40, Math.min(room, Math.round(BOX_CANVAS_MAX_H * w / h))), cssH = Math.round(cssW * h / w);
  const c = $("boxes-canvas"), dpr = window.devicePixelRatio || 1;
  c.style.width = `${cssW}px`; c.style.height = `${cssH}px`;
  c.width = Math.round(cssW * dpr); c.height = Math.round(cssH * dpr);
  drawBoxes();
}

function drawBoxes() {
  const c = $("boxes-canvas"), g = c.getContext("2d"), W = c.width, H = c.height, dpr = window.devicePixelRatio || 1;
  g.clearRect(0, 0, W, H);
  g.fillStyle = "rgba(128, 128, 128, .18)"; g.fillRect(0, 0, W, H);
  g.font = `${12 * dpr}px -apple-system, BlinkMacSystemFont, "Segoe UI", sans-serif`; g.textBaseline = "top";
  layout.boxes.forEach((b, i) => {
    const [x, y, w, h] = [b.x0 * W, b.y0 * H, (b.x1 - b.x0) * W, (b.y1 - b.y0) * H], color = boxColor(i);
    if (i === layout.selected) { g.fillStyle = color + "40"; g.fillRect(x, y, w, h); }
    g.setLineDash([]); g.lineWidth = (i === layout.selected ? 3 : 1.5) * dpr; g.strokeStyle = color;
    g.strokeRect(x, y, w, h);
    const text = `${i + 1} ${b.desc.trim() || "(no name)"}`, tw = g.measureText(text).width + 6 * dpr;
    g.fillStyle = color; g.fillRect(x, y, tw, 16 * dpr);  // the name on its colour, at the top-left corner
    g.fillStyle = "#fff"; g.fillText(text, x + 3 * dpr, y + 2 * dpr);
  });
  const d = layout.drag;
  if (d && d.moved) {  // the box being drawn: dashed until it is let go
    g.setLineDash([4 * dpr, 3 * dpr]); g.lineWidth = 1.5 * dpr; g.strokeStyle = boxColor(layout.boxes.length);
    g.strokeRect(d.from[0] * W, d.from[1] * H, (d.to[0] - d.from[0]) * W, (d.to[1] - d.from[1]) * H);
  }
}

// One row a box: its colour and number, the name field, the coordinates (x0,y0,x1,y1) and a delete button.
function renderBoxRows() {
  $("boxes-list").replaceChildren(...layout.boxes.map((b, i) => {
    const row = document.createElement("div"); row.className = "box-row"; row.classList.toggle("on", i === layout.selected);
    const tag = document.createElement("span"); tag.className = "box-tag"; tag.textContent = i + 1;
    tag.style.background = boxColor(i);
    const name = document.createElement("input"); name.className = "box-name"; name.value = b.desc;
    name.placeholder = "what is here, e.g. a red car"; name.setAttribute("aria-label", `box ${i + 1}'s name`);
    name.addEventListener("input", () => { b.desc = name.value; drawBoxes(); });
    name.addEventListener("focus", () => selectBox(i));
    const coords = document.createElement("code"); coords.className = "box-coords"; coords.textContent = boxCoords(b);
    coords.title = "x0,y0,x1,y1: fractions of the width and height, from the top-left corner";
    const del = document.createElement("button"); del.type = "button"; del.className = "box-delete";
    del.textContent = "×"; del.title = "delete this box"; del.onclick = () => deleteBox(i);
    row.append(tag, name, coords, del);
    return row;
  }));
  $("boxes-clear").disabled = !layout.boxes.length;
  drawBoxes();
}

function selectBox(i) {
  if (layout.selected === i) return;
  layout.selected = i;
  [...$("boxes-list").children].forEach((row, j) => row.classList.toggle("on", j === i));
  drawBoxes();
}
function deleteBox(i) {
  layout.boxes.splice(i, 1);
  layout.selected = layout.selected === i ? -1 : layout.selected - (layout.selected > i ? 1 : 0);
  renderBoxRows();
}

// The topmost (last drawn) box under a point of the canvas, or -1.
function boxAt([x, y]) {
  for (let i = layout.boxes.length - 1; i >= 0; i--) {
    const b = layout.boxes[i];
    if (b.x0 <= x && x <= b.x1 && b.y0 <= y && y <= b.y1) return i;
  }
  return -1;
}
function canvasPoint(e) {
  const r = $("boxes-canvas").getBoundingClientRect();
  return [Math.min(1, Math.max(0, (e.clientX - r.left) / r.width)), Math.min(1, Math.max(0, (e.clientY - r.top) / r.height))];
}
// A drag ends: a box at least MIN_BOX_PX each way is added (selected, its name field focused); a click selects.
function endDrag() {
  const d = layout.drag, r = $("boxes-canvas").getBoundingClientRect();
  layout.drag = null;
  const [xa, xb] = [d.from[0], d.to[0]].sort((a, b) => a - b), [ya, yb] = [d.from[1], d.to[1]].sort((a, b) => a - b);
  const box = { x0: unit(xa), y0: unit(ya), x1: unit(xb), y1: unit(yb), desc: "" };
  if ((xb - xa) * r.width < MIN_BOX_PX || (yb - ya) * r.height < MIN_BOX_PX || box.x0 >= box.x1 || box.y0 >= box.y1) {
    selectBox(boxAt(d.from)); drawBoxes();
    return;
  }
  layout.boxes.push(box); layout.selected = layout.boxes.length - 1;
  renderBoxRows();
  $("boxes-list").lastElementChild.querySelector(".box-name").focus();
}

// A box as a request's string; a record's (diffusers' dict, bbox [y0, x0, y1, x1]) or a string back to a box.
function boxSpec(b) { return `${b.x0},${b.y0},${b.x1},${b.y1}:${b.desc.trim()}`; }
function readBox(v) {
  if (typeof v === "string") {
    const cut = v.indexOf(":"), n = (cut < 0 ? v : v.slice(0, cut)).split(",").map(Number);
    return n.length === 4 ? { x0: n[0], y0: n[1], x1: n[2], y1: n[3], desc: cut < 0 ? "" : v.slice(cut + 1) } : null;
  }
  if (!v || !Array.isArray(v.bbox) || v.bbox.length !== 4) return null;  // an edit's moved-element box: not drawable
  const [y0, x0, y1, x1] = v.bbox.map(Number);
  return { x0, y0, x1, y1, desc: typeof v.desc === "string" ? v.desc : "" };
}

export function boxesForRequest() { return boxesOffered() && layout.boxes.length ? layout.boxes.map(boxSpec) : null; }
// What the server would refuse, said before anything is sent ("" when the boxes are fine or not offered).
export function boxesProblem() {
  if (!boxesOffered()) return "";
  const i = layout.boxes.findIndex((b) => !b.desc.trim());
  if (i < 0) return "";
  selectBox(i); $("boxes-list").children[i].querySelector(".box-name").focus();
  return `box ${i + 1} has no name: type what it holds (e.g. "a red car") or delete it`;
}
export function setBoxes(list) {
  layout.boxes = (list || []).map(readBox).filter(Boolean).map((b) => ({ ...b, desc: b.desc.trim() }));
  layout.selected = -1;
  renderBoxRows();
}

const boxCanvas = $("boxes-canvas");
boxCanvas.addEventListener("pointerdown", (e) => {
  e.preventDefault(); boxCanvas.setPointerCapture(e.pointerId); boxCanvas.focus();
  const p = canvasPoint(e);
  layout.drag = { from: p, to: p, moved: false };
});
boxCanvas.addEventListener("pointermove", (e) => {
  if (!layout.drag) return;
  layout.drag.to = canvasPoint(e); layout.drag.moved = true; drawBoxes();
});
boxCanvas.addEventListener("pointerup", (e) => { if (layout.drag) { layout.drag.to = canvasPoint(e); endDrag(); } });
boxCanvas.addEventListener("pointercancel", () => { layout.drag = null; drawBoxes(); });
boxCanvas.addEventListener("keydown", (e) => {
  if ((e.key === "Delete" || e.key === "Backspace") && layout.selected >= 0) { e.preventDefault(); deleteBox(layout.selected); }
});
$("boxes-clear").addEventListener("click", () => setBoxes([]));
for (const id of ["width", "height"]) $(id).addEventListener("input", sizeBoxCanvas);
window.addEventListener("resize", sizeBoxCanvas);
renderBoxRows();
