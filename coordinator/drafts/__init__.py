"""Draft sources: prompt lookup (lookup.py) and the model's MTP head (mtp.py); the decode core checks what
they propose, never trusts it."""
