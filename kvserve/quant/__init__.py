"""Weight quantisation: the config (plain data), kvserve's packed layout and
its torch reference, checkpoint formats, and the linear methods the layers use."""
