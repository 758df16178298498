"""The only code that mutates the user's modules: recipes applied, the trial step, snapshot and
restore, the optimizer re-bound."""
