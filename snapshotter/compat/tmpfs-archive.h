/* Part 12 of the CRIU shim: tmpfs archives without tar (tmpfs-archive.c). */
#ifndef GROVE_TMPFS_ARCHIVE_H
#define GROVE_TMPFS_ARCHIVE_H

/* Returned where GNU tar is to do the job instead (nothing was left written). */
#define TAR_UNSUPPORTED 1

/* Writes the tree under the directory `dir` to `out` (a regular file) as a POSIX ustar archive:
 * 0, TAR_UNSUPPORTED (out rewound and truncated to where it was) or -1 (it could not be). */
int tar_create(int dir, int out);

/* Extracts the plain archive read from `in` (a regular file, at its offset; the offset is left
 * as it was) into `target`: 0, or not 0 where GNU tar is to extract it (over what was made). */
int tar_extract(int in, const char *target);

#endif
