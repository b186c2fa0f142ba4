"""LoRA and LoKr training on klein Base, laid out along the flow of a run, floor by floor; a module
imports only the floors below it (tests/test_layering.py):

    1  step/      objective (flow matching, AdamW, the lr schedule), optimizers, adapters, distributed
       data/dataset, memory, starting (--init-lora), report/events, report/metrics
    2  settings   what a run asks for, checked;  workdir: the work folder, its mark and its lock
    3  config_file  settings from a TOML or an earlier train.json;  state: checkpoints, the output
    4  data/captions, data/latents (the caches);  report/evaluation (EMA, validation, loss.png),
       report/samples (images on the model the LoRA runs on)
    5  plan       everything checked before a model loads
    6  trainer    the run, step by step
    7  command    `train`

Nothing but `__main__` imports this wing (and `__init__`'s lazy `train_lora`, `TrainSettings`)."""
