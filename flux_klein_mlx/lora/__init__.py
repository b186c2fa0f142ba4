"""LoRA and LoKr files: read from every trainer's layout onto our layers (`formats`), written in ours
(`layouts`: diffusers, ComfyUI, kohya), the one side-path layer of inference and training
(`layers`), parsed, checked and applied to a model (`apply`), and whole files converted and
described (`convert`, behind the `lora convert | info` command)."""
