"""A run's caption embeddings: read from the prompt cache where they are, the rest encoded once with the
text encoder (released after) and stored there, so a resume never loads the encoder.

The texts are the training captions (each once), the held-out captions of --validation and, under
--caption-dropout, the empty caption a dropped example trains with; the sample prompts are the sample
model's own (samples.py). What the log says counts texts, the same number before and after:

    encoding 5 captions with the text encoder ...                 (none cached)
    encoding 1 of 6 texts with the text encoder (5 captions + the empty caption; 5 from the prompt cache) ...
    captions: 1 text encoded, text encoder released (2.1 s)
"""

from __future__ import annotations

import time

import mlx.core as mx

from ...errors import FluxKleinError
from ...models.tokenizer import load_tokenizer
from ...run.components import load_component
from ...storage.embedding_cache import open_cache, prompt_keys
from ..report.events import StageFinished, StageStarted, plural

ENCODE_CHUNK = 4  # texts per text-encoder call: a few at a time bounds the activations


class CaptionEmbeddings:
    """caption -> (1, Lt, E) embeddings of the run (`ctx`), from the prompt cache or the text encoder."""

    def __init__(self, settings, info, dtype, captions: list[str]):
        self.settings = settings
        self.info = info
        self.dtype = dtype
        self.captions = list(dict.fromkeys(captions))
        # the caption a dropped example trains with
        self.extra = [""] if settings.caption_dropout > 0 and "" not in self.captions else []
        self.texts = self.captions + self.extra
        self.ctx: dict = {}
        self.cache = None
        self.keys = {t: None for t in self.texts}

    def plan(self) -> StageStarted:
        """Read what the prompt cache holds; say what is left to encode (in texts, as `encode` will)."""
        settings = self.settings
        self.cache = open_cache(True)
        # Training's own entries ("for"): it encodes up to 4 texts a batch, the pipeline all at once, and
        # the two need not agree to the bit; a resume reads back exactly what the first run trained on.
        quantization = {"bits": settings.quantize, "group_size": settings.group_size} if settings.quantize else None
        # FLUX 3's taps and window are part of its key (the family's text_key; FLUX.2's adds nothing)
        key_settings = {
            "dtype": settings.dtype,
            "quantization": quantization,
            "for": "train",
            **self.info.family.text_key,
        }
        if self.cache is not None:
            self.keys = prompt_keys(
                self.cache,
                self.info.files["text_encoder"],
                tokenizer=self.info.tokenizer,
                prompts=self.texts,
                settings=key_settings,
            )
        for text, key in self.keys.items():
            if key is not None and (hit := self.cache.get(key)) is not None:
                self.ctx[text] = hit
        what = plural(len(self.captions), "caption") + (" + the empty caption" if self.extra else "")
        missing = sum(t not in self.ctx for t in self.texts)
        if not missing:
            return StageStarted(
                stage="captions", detail=f"{what}: all in the prompt cache, the text encoder is not loaded"
            )
        cached = len(self.texts) - missing
        if not cached and not self.extra:  # every text a caption, none cached: they are the same count
            return StageStarted(stage="captions", detail=f"encoding {what} with the text encoder ...")
        source = f"{what}; {cached} from the prompt cache" if cached else what
        return StageStarted(
            stage="captions",
            detail=f"encoding {missing} of {plural(len(self.texts), 'text')} with the text encoder ({source}) ...",
        )

    def encode(self, load_component=load_component) -> StageFinished:
        """Encode the texts `plan` did not find in the prompt cache (the text encoder from `load_component`,
        the trainer's), and store them there."""
        t0 = time.perf_counter()
        texts = [t for t in self.texts if t not in self.ctx]
        if not texts:
            return StageFinished(
                stage="captions", seconds=time.perf_counter() - t0, detail="read from the prompt cache"
            )
        tokenizer = load_tokenizer(self.info.tokenizer)
        encoder = load_component(
            self.info,
            "text_encoder",
            self.dtype,
            quantize=self.settings.quantize,
            group_size=self.settings.group_size,
        )
        for k in range(0, len(texts), ENCODE_CHUNK):
            chunk = texts[k : k + ENCODE_CHUNK]
            # each (1, Lt, E): FLUX.2's window is 512, FLUX 3's each text's own (its length rounded up to 80)
            emb = [e.astype(self.dtype) for e in self.info.family.encode_prompts(encoder, tokenizer, chunk)]
            mx.eval(emb)
            if not all(mx.all(mx.isfinite(e)).item() for e in emb):
                raise FluxKleinError(f"non-finite prompt embeddings for {chunk[0]!r}: try --dtype float32")
            for i, t in enumerate(chunk):
                self.ctx[t] = emb[i]
                if self.keys[t] is not None:  # the resumed run reads them back, bit for bit
                    self.cache.put(self.keys[t], self.ctx[t])
        del encoder
        mx.clear_cache()
        return StageFinished(
            stage="captions",
            seconds=time.perf_counter() - t0,
            detail=f"{plural(len(texts), 'text')} encoded, text encoder released",
        )
