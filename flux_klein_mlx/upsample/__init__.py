"""The FLUX 3 prompt upsampler and layout boxes."""
