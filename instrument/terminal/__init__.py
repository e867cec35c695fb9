"""Terminal rendering: the console step table, validation-sample panels, run logs and tqdm-safe output."""
