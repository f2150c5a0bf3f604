/*
** The C tests' harness: CHECK(cond, fmt, ...) counts a pass, or counts a failure and prints it with its
** file:line; CHECK_REPORT() prints "N passed, N failed" and gives main's exit status.
*/
#ifndef MS_CHECK_H
#define MS_CHECK_H

#include <stdio.h>

static int check_passed, check_failed;

#define CHECK(cond, ...)                                                 \
    do {                                                                 \
        if (cond) {                                                      \
            check_passed++;                                              \
        } else {                                                         \
            check_failed++;                                              \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);                  \
            printf(__VA_ARGS__);                                         \
            printf("\n");                                                \
        }                                                                \
    } while (0)

#define CHECK_REPORT() (printf("%d passed, %d failed\n", check_passed, check_failed), check_failed ? 1 : 0)

#endif /* MS_CHECK_H */
