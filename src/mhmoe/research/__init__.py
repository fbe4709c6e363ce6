"""Research tools on top of the trainer: paper-table reproduction (:mod:`.reproduce`), routing analysis
(:mod:`.analysis`) and the MoE layer benchmark's library part (:mod:`.bench`, :mod:`.bench_peers`)."""
