"""Remote twins of the embedding modules and the per-rank embedding pipeline that feeds them.

``modules`` (the twins) depend on ``row_source`` (the protocol that gives them rows) and ``planning`` (their
input turned into unique ids per table, as plain data that also runs in DataLoader workers). ``pipeline``
implements the row source for training, from ``context`` (a step's state), ``scheduler`` (lookahead and
staleness window), ``pusher`` (gradients, finiteness, acknowledgements; ``rank_merge`` across ranks),
``prefetch`` (the dataloader wrapper) and ``batch_rows`` (a lookup's rows); ``phases`` names its profiler spans.
"""
