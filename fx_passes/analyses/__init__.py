"""What FX passes read off a traced program (graph facts, attention cores, masks, rotary tables):
analyses, not passes; they change nothing."""
