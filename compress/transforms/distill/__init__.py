"""Distillation: building a student from the teacher and training it by knowledge distillation."""
