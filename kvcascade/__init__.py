"""kvcascade: prefix-aware, cascading LLM serving. The command line lives in kvcascade.cli."""
