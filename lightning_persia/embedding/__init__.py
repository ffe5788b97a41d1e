"""Remote twins of the embedding modules and the per-rank embedding worker that feeds them."""
