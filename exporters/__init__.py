"""Exporters: Hugging Face targets and DFlash/DSpark drafts to OpenVINO IR."""
