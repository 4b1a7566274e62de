"""Activation offload at run time (torch): the session, its dispatch-mode executor, the
residency of activation storages and the copy runtimes."""
