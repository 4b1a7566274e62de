"""Thin integrations of swapopt with training frameworks.

Each integration lives in its own module and imports its framework there, so importing
this package costs nothing: ``from swapopt_plugins.lightning import SwapOptimizerCallback``.
"""
