"""Test helpers: fakes of trainkit's seams, and scripts the tests start in other processes."""
