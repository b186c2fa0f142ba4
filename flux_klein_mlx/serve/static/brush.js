// The mask brush (inpainting): painted on the first image, sent as a mask of its size (white = repaint, on
// black). The file list is page.js's (`actions.renderFiles`).
import { $, actions, state } from "./state.js";

export function openBrush() {
  const first = state.refs[0];
  if (!first) return;
  state.brushFor = first;
  const c = $("brush");
  c.width = first.width; c.height = first.height;  // the image's own pixels: the mask is its size
  $("brush-img").src = URL.createObjectURL(first.file);
  $("brush-box").classList.remove("hidden"); $("brush-open").classList.add("hidden");
}
export function clearBrush() {
  const c = $("brush");
  c.getContext("2d").clearRect(0, 0, c.width, c.height);
  if (state.mask && state.mask.painted) state.mask = null;
}
function brushTool(erase) {
  state.erase = erase;
  $("brush-paint").classList.toggle("on", !erase); $("brush-erase").classList.toggle("on", erase);
}
function brushPoint(e) {
  const c = $("brush"), r = c.getBoundingClientRect();
  return [(e.clientX - r.left) * c.width / r.width, (e.clientY - r.top) * c.height / r.height];
}
function brushStroke(from, to) {
  const g = $("brush").getContext("2d");
  g.globalCompositeOperation = state.erase ? "destination-out" : "source-over";
  g.strokeStyle = "#fff"; g.lineWidth = Number($("brush-size").value); g.lineCap = "round"; g.lineJoin = "round";
  g.beginPath(); g.moveTo(...from); g.lineTo(...to); g.stroke();
}
async function exportMask() {
  const c = $("brush"), out = document.createElement("canvas");
  out.width = c.width; out.height = c.height;
  const g = out.getContext("2d");
  g.fillStyle = "#000"; g.fillRect(0, 0, out.width, out.height); g.drawImage(c, 0, 0);
  const blob = await new Promise((resolve) => out.toBlob(resolve, "image/png"));
  state.mask = { file: new File([blob], "mask.png", { type: "image/png" }), width: out.width, height: out.height, painted: true };
  actions.renderFiles();
}
$("brush").addEventListener("pointerdown", (e) => {
  e.preventDefault(); $("brush").setPointerCapture(e.pointerId);
  state.stroke = brushPoint(e); brushStroke(state.stroke, state.stroke);
});
$("brush").addEventListener("pointermove", (e) => {
  if (!state.stroke) return;
  const p = brushPoint(e); brushStroke(state.stroke, p); state.stroke = p;
});
for (const end of ["pointerup", "pointercancel"]) {
  $("brush").addEventListener(end, () => { if (state.stroke) { state.stroke = null; exportMask(); } });
}
$("brush-open").addEventListener("click", openBrush);
$("brush-paint").addEventListener("click", () => brushTool(false));
$("brush-erase").addEventListener("click", () => brushTool(true));
$("brush-clear").addEventListener("click", () => { clearBrush(); actions.renderFiles(); });
