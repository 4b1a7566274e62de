"""The training step as a whole, above both halves: the whole-step device budget
(``budget.py``: its plan and meter) and the one owner of the hooks swapopt puts on an
optimizer's ``step`` (``hooks.py``). The activation executor and the swap engine sit below;
nothing below imports the budget."""
