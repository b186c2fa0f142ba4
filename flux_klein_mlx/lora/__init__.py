"""LoRA files from every trainer read onto our layers (`formats`), parsed, checked and applied (`apply`)."""
