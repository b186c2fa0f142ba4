// Outpainting on the page: the first image drawn on a canvas inside a larger frame, whose four edges are
// dragged (pointer events: mouse, touch, pen) or typed to add pixels on that side. The pads are rounded as
// the server rounds them (flux_klein_mlx/inputs/outpaint.py round_pads: multiples of 16), shown, and sent as the
// edit's `outpaint` field ("LEFT,TOP,RIGHT,BOTTOM" px) by page.js's request. page.js calls
// `outpaint.open / follow / active / pads / refusal`; this calls back its `describeMode` (`actions`).
import { $, actions, state } from "./state.js";

export const outpaint = (() => {
  const GRID = 16, MAX_SIDE = 4096;  // the server's token grid in px, and its largest side (limits.MAX_SIDE)
  const SIDES = ["left", "top", "right", "bottom"];
  const FIT = 0.7, MAX_ZOOM = 4;  // the canvas fills at most 70% of the frame, a small image at most 4x
  // image: the page's image ({file, width, height}) being extended; asked: the px asked per side (dragged or
  // typed, before rounding); scale: screen px per image px; at: the image's top-left in the frame, screen px.
  const view = { image: null, bitmap: null, asked: [0, 0, 0, 0], scale: 1, at: [0, 0], drag: null };

  // round_pads: left and top up to multiples of 16; right and bottom take what makes each canvas side one.
  function pads() {
    if (!view.image) return [0, 0, 0, 0];
    const up = (n) => Math.ceil(n / GRID) * GRID, { width: w, height: h } = view.image, [l, t, r, b] = view.asked;
    const left = up(l), top = up(t);
    return [left, top, up(left + w + r) - left - w, up(top + h + b) - top - h];
  }
  function canvasSize() {
    const [l, t, r, b] = pads();
    return [view.image.width + l + r, view.image.height + t + b];
  }
  const active = () => view.image !== null && view.image === state.refs[0];

  // Why this outpaint cannot be sent (one line), or null.
  function refusal() {
    const [w, h] = canvasSize();
    if (w > MAX_SIDE || h > MAX_SIDE) {
      return `the canvas would be ${w} × ${h} px, past the server's ${MAX_SIDE} px a side: drag an edge back (or reset)`;
    }
    if (!pads().some(Boolean)) return "drag an edge of the image (or type pixels per side) to add canvas first";
    if (state.mask) return "outpainting paints the new area itself: remove the mask first";
    return null;
  }

  async function open(image) {
    const bitmap = await createImageBitmap(image.file);
    if (view.bitmap) view.bitmap.close();
    Object.assign(view, { image, bitmap, asked: [0, 0, 0, 0], drag: null });
    $("outpaint-box").classList.remove("hidden");
    fit(); draw();
    $("outpaint-box").scrollIntoView({ block: "nearest" });
    actions.describeMode();
  }
  function close() {
    if (view.bitmap) view.bitmap.close();
    Object.assign(view, { image: null, bitmap: null, asked: [0, 0, 0, 0], drag: null });
    $("outpaint-box").classList.add("hidden");
  }
  // After the page's images change: the view closes once its image is no longer the first.
  function follow() { if (view.image && !active()) close(); }

  // The whole canvas centred in the frame at the scale that fits it (between drags: a drag keeps its scale).
  function fit() {
    const frame = $("outpaint-frame"), [w, h] = canvasSize(), [l, t] = pads();
    view.scale = Math.min(FIT * frame.clientWidth / w, FIT * frame.clientHeight / h, MAX_ZOOM);
    view.at = [(frame.clientWidth - w * view.scale) / 2 + l * view.scale,
               (frame.clientHeight - h * view.scale) / 2 + t * view.scale];
  }

  function draw() {
    const [w, h] = canvasSize(), [l, t, r, b] = pads(), s = view.scale, area = $("outpaint-area");
    Object.assign(area.style, { left: `${view.at[0] - l * s}px`, top: `${view.at[1] - t * s}px`,
                                width: `${w * s}px`, height: `${h * s}px` });
    area.dataset.scale = String(s);
    const c = $("outpaint-canvas"), dpr = window.devicePixelRatio || 1;
    c.width = Math.max(1, Math.round(w * s * dpr)); c.height = Math.max(1, Math.round(h * s * dpr));
    const g = c.getContext("2d");
    g.setTransform(dpr * s, 0, 0, dpr * s, 0, 0);  // image px from here on
    g.fillStyle = "rgba(10, 102, 216, .18)"; g.fillRect(0, 0, w, h);  // the new area
    g.drawImage(view.bitmap, l, t, view.image.width, view.image.height);
    g.setLineDash([4 / s, 4 / s]); g.lineWidth = 1 / s; g.strokeStyle = "#0a66d8";
    g.strokeRect(l, t, view.image.width, view.image.height);
    const run = [l, t, r, b];
    SIDES.forEach((side, i) => {
      const asked = view.asked[i];
      $(`outpaint-amount-${side}`).textContent =
        `${side} ${run[i] ? "+" : ""}${run[i]}` + (asked !== run[i] ? ` (${asked} rounded to ${GRID})` : "");
      if (document.activeElement !== $(`outpaint-${side}`)) $(`outpaint-${side}`).value = String(asked);
    });
    $("outpaint-size").textContent = `canvas ${w} × ${h} px (the image ${view.image.width} × ${view.image.height})`;
    const why = refusal();
    $("outpaint-warn").textContent = why && why.startsWith("the canvas") ? why : "";
  }

  // ---- dragging an edge: the pointer's travel in screen px / scale = px added on that side -------------
  function travel(e) {
    const d = view.drag, side = SIDES[d.side];
    return side === "left" ? d.x - e.clientX : side === "right" ? e.clientX - d.x
      : side === "top" ? d.y - e.clientY : e.clientY - d.y;
  }
  function dragTo(e) {
    const d = view.drag;
    view.asked[d.side] = Math.max(0, Math.round(d.from + travel(e) / view.scale));
    draw();
  }
  for (const handle of document.querySelectorAll("#outpaint-area .op-handle")) {
    handle.addEventListener("pointerdown", (e) => {
      e.preventDefault(); handle.setPointerCapture(e.pointerId);
      const side = SIDES.indexOf(handle.dataset.side);
      view.drag = { side, x: e.clientX, y: e.clientY, from: view.asked[side] };
    });
    handle.addEventListener("pointermove", (e) => { if (view.drag) dragTo(e); });
    for (const end of ["pointerup", "pointercancel"]) {
      handle.addEventListener(end, (e) => {
        if (!view.drag) return;
        if (end === "pointerup") dragTo(e);
        view.drag = null; fit(); draw();
      });
    }
  }
  SIDES.forEach((side, i) => {
    $(`outpaint-${side}`).addEventListener("input", (e) => {
      const v = Number(e.target.value);
      view.asked[i] = Number.isFinite(v) && v > 0 ? Math.floor(v) : 0;
      if (view.image) { fit(); draw(); }
    });
  });
  $("outpaint-reset").addEventListener("click", () => { view.asked = [0, 0, 0, 0]; fit(); draw(); });
  $("outpaint-close").addEventListener("click", () => { close(); actions.describeMode(); });
  $("outpaint-send").addEventListener("click", () => $("form").requestSubmit());
  window.addEventListener("resize", () => { if (view.image && !view.drag) { fit(); draw(); } });

  return { open, close, follow, active, pads, refusal };
})();
