"""Plan installation: the trio-side installer that follows the agreement (`installer`) and
the fetch of a plan's Hugging Face files (`hub_fetch`)."""
