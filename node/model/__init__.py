"""The rank's share of the model: loading (load), pipeline stages (stage), tensor shards
(tensor), vision-language models (vlm), speculative proposers (draft)."""
