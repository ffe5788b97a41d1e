"""Remote twins of the embedding modules and the per-rank embedding pipeline that feeds them.

``modules`` (the twins) depend on ``row_source`` (the protocol that gives them rows); ``pipeline`` implements it
for training, from ``context`` (a step's state), ``scheduler`` (lookahead and staleness window), ``pusher``
(gradients, merge, acknowledgements), ``prefetch`` (the dataloader wrapper) and ``batch_rows`` (a lookup's rows).
"""
