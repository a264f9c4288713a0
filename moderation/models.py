# Policies and checks arrive with the moderation issue.
