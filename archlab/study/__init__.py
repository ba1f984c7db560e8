"""Studies: controlled architecture experiments on Optuna (``archlab study``)."""
