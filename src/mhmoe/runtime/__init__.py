"""Process-level runtime helpers with no model knowledge: device selection and autocast
(:mod:`.device`), the opt-in CPU allocator setting (:mod:`.cpu_malloc`)."""
