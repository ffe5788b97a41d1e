"""The disk tier of a table: the rows its memory budget does not hold, in segment files, and what keeps them.

Layered as each module imports the ones before it: ``records`` (the record layout and its file I/O),
``segment_mapping`` (segments kept in the page tables), ``read_ahead`` (records read without the table's lock),
``compaction`` (when a segment's live rows are moved), ``tier`` (the segments and their id map), ``id_map_file``
and ``checkpoint`` (a checkpoint's links to the segments and its saved id map), ``promotions`` (rows queued to come
back into memory), ``mapped_budget`` and ``demoter`` (the shard's background steps), ``tier_folders`` (where a
shard's tiers live)."""
