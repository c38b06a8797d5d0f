"""alpamayo-serve: one Pipeline behind HTTP front doors (OpenAI-compatible JSON, a compact
msgpack endpoint for the node, the FlashDrive sidecar protocol) and its ROS-free client."""
