"""The torch backend: the swap engine for ``torch.optim`` optimizers, its staging, its
runtimes (loopback and CUDA) and the Adam/AdamW family."""
