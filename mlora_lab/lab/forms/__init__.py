"""The notebook forms that build jobs, and the field inputs they are made of."""
