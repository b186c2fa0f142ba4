"""The request the prompt upsampler answers, built as diffusers builds it, before any model loads.

    request = build_request("make it night", images=[room], boxes=[...])   # checked; references prepared
    request.mode          # "t2i" | "i2i" | "t2i_bbox" | "i2i_bbox": images make it an edit, boxes a layout
    request.messages()    # the chat: the mode's system prompt, then the user turn (images first, then text)

Reference images are shown to the upsampler as it saw them in training: EXIF-rotated, transparency
over white, resized (Lanczos) to sides that are multiples of 32 within the pixel budget for their count
(1 MP for one, 724^2 for two, 512^2 for three to ten), then JPEG-encoded at quality 92 and decoded.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from PIL import Image, ImageOps

from ..errors import FluxKleinError
from .boxes import canvas_rows, check_boxes, layout_request, reconcile
from .prompts import EDIT_SCAFFOLDS, SYSTEM_PROMPTS

UPSAMPLER_MAX_REFERENCES = 10
MAX_NEW_TOKENS = 3584  # diffusers' and BFL's cap on a caption
SIDE_MULTIPLE = 32
MAX_ASPECT_RATIO = 200
JPEG_QUALITY = 92


def pixel_budget(count: int) -> int:
    """The most pixels one of `count` references may keep."""
    return {1: 1024 * 1024, 2: 724 * 724}.get(count, 512 * 512)


def reference_size(width: int, height: int, count: int) -> tuple[int, int]:
    """The (width, height) a reference of `count` is shown at: each side rounded to a multiple of 32 and,
    over the budget, scaled down to it (sides floored), the wider side trimmed if rounding still overshoots."""
    if max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise FluxKleinError(
            f"a {width}x{height} reference image is too narrow for the prompt upsampler (aspect ratio over "
            f"{MAX_ASPECT_RATIO}:1); crop it"
        )
    budget = pixel_budget(count)

    def floored(v: float) -> int:
        return max(SIDE_MULTIPLE, math.floor(v / SIDE_MULTIPLE) * SIDE_MULTIPLE)

    w, h = (max(SIDE_MULTIPLE, round(v / SIDE_MULTIPLE) * SIDE_MULTIPLE) for v in (width, height))
    if w * h > budget:
        scale = math.sqrt(width * height / budget)
        w, h = floored(width / scale), floored(height / scale)
    if w * h > budget:
        if w == SIDE_MULTIPLE:
            h = floored(budget / w)
        else:
            w = floored(budget / h)
    return w, h


def shown_reference(image: Image.Image, count: int) -> Image.Image:
    """One reference image (of `count`) as the upsampler sees it: RGB, resized, through JPEG q92."""
    image = ImageOps.exif_transpose(image)
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    image = image.convert("RGB")
    size = reference_size(image.width, image.height, count)
    if image.size != size:
        image = image.resize(size, Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    with Image.open(io.BytesIO(buffer.getvalue())) as decoded:
        return decoded.convert("RGB")


def check_upsampler_references(count: int) -> None:
    if count > UPSAMPLER_MAX_REFERENCES:
        raise FluxKleinError(
            f"the prompt upsampler reads at most {UPSAMPLER_MAX_REFERENCES} reference images, not {count}; "
            "give fewer images, or leave {upsample} out and write the caption yourself"
        )


@dataclass
class UpsampleRequest:
    """One request: the prompt as typed, the mode, the references as shown, the locked rows (0-1000)."""

    prompt: str
    mode: str
    references: list[Image.Image] = field(default_factory=list)
    locked: list[dict] = field(default_factory=list)
    boxes: tuple[dict, ...] = ()  # the user's boxes, checked (0-1), as the record keeps them

    def user_text(self) -> str:
        text = layout_request(self.prompt, self.locked) if self.locked else self.prompt
        if self.references:
            text = EDIT_SCAFFOLDS[bool(self.locked)].format(instruction=text)
        return text

    def messages(self) -> list[dict]:
        """The chat in the processor's form: parts lists; `{"type": "image"}` marks each reference in turn."""
        images = [{"type": "image"} for _ in self.references]
        return [
            {"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPTS[self.mode]}]},
            {"role": "user", "content": images + [{"type": "text", "text": self.user_text()}]},
        ]

    def finish(self, answer: str) -> str:
        """The caption the transformer reads from the upsampler's answer (a layout reconciled with the locks)."""
        answer = answer.strip()
        if not answer:
            raise FluxKleinError("the prompt upsampler returned an empty caption; try again with another prompt")
        return reconcile(answer, self.locked) if self.locked else answer

    def identity(self) -> str:
        """Everything of the request that decides the caption, as text (the caption cache's key)."""
        shown = [hashlib.sha256(im.tobytes()).hexdigest() + f"{im.size}" for im in self.references]
        data = {"mode": self.mode, "prompt": self.prompt, "locked": self.locked, "references": shown}
        return json.dumps(data, sort_keys=True, ensure_ascii=False)


def build_request(prompt: str, images: Sequence[Image.Image] = (), boxes: Sequence | None = None) -> UpsampleRequest:
    """The checked request for `prompt`, the edit's reference images (opened PIL images) and the user's boxes."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise FluxKleinError("the prompt upsampler needs a prompt to expand; give {prompt}")
    check_upsampler_references(len(images))
    checked = check_boxes(boxes, prompt, references=len(images), upsample=True)
    mode = ("i2i" if images else "t2i") + ("_bbox" if checked else "")
    shown = [shown_reference(image, len(images)) for image in images]
    return UpsampleRequest(prompt=prompt, mode=mode, references=shown, locked=canvas_rows(checked), boxes=checked)


def check_upsampler_family(family, *, upsample: bool) -> None:
    """--upsample and --box are FLUX 3's (its family names an upsampler); one line saying what they are for."""
    if family.upsampler is not None:
        return
    if upsample:
        raise FluxKleinError(
            f"{{upsample}} is for FLUX 3 Image Klein: it rewrites a short prompt into the full scene caption that "
            f"model was trained on, with BFL's prompt upsampler; {family.title} reads your prompt as written "
            "(leave {upsample} out)"
        )
    raise FluxKleinError(
        f"{{boxes}} is for FLUX 3 Image Klein, whose transformer reads a layout of boxes; {family.title} has none "
        "(leave {boxes} out and say where things go in the prompt)"
    )
