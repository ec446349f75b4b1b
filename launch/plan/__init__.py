"""moe-plan: predicted memory, bytes per link, bubble, step time and MFU of a layout; layout search."""
