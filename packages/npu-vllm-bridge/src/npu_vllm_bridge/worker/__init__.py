"""The NPU worker and model runners, and what the NPU and host workers share."""
