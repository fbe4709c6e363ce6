"""Other ecosystems and export formats: Hugging Face transformers (:mod:`.hf`), the LM Evaluation Harness
backend and offline tasks (:mod:`.lmeval`, :mod:`.lmeval_tasks`), and the BitNet packed 2-bit weights
(:mod:`.bitnet_packed`). Optional dependencies are imported only here."""
