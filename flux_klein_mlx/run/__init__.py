"""A model and its run: what a model is, from its files (`loading.describe`), one component loaded
(`components`), and the pipeline that runs the stages of an image (`pipeline`)."""
