"""Built-in plugins, registered by ``get_plugin_manager`` like any third-party plugin."""

DEFAULT_PLUGINS = (
    "swapopt_core.builtin.loopback",
    "swapopt_core.builtin.cuda",
    "swapopt_core.builtin.torch_adam",
    "swapopt_core.builtin.timed_planner",
    "swapopt_core._mindspore.plugin",
)
